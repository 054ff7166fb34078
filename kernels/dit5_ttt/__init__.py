from typing import Optional

import torch
from timm.layers import register_notrace_function

from ..dispatch import get_op
from .reference import mlp_ttt_reference

__all__ = ["mlp_ttt", "mlp_ttt_reference"]


@register_notrace_function  # device dispatch: a leaf for torch.fx
def mlp_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            scale: float, backend: Optional[str] = None) -> torch.Tensor:
    """DiT5 2-layer SiLU-MLP regression inner step + apply (op ``dit5_mlp_ttt``); see ``reference.py``."""
    if torch.jit.is_scripting():
        return mlp_ttt_reference(q, k, v, w1, w2, scale)
    return get_op("dit5_mlp_ttt", q.device, backend)(q, k, v, w1, w2, scale)
