"""TTT ops (installed as ``ttt_zoo.kernels``): one folder per op with its reference and kernels."""
from typing import Optional

import torch
from timm.layers import register_notrace_function

from .dispatch import available_ops, get_op, register_op, resolve_backend
from .vit3_ttt import dwconv_ttt_reference, swiglu_ttt_reference
from .dit5_ttt import mlp_ttt, mlp_ttt_reference
from .t5_ttt import t5_swiglu_ttt_reference

register_op("vit3_swiglu_ttt", swiglu_ttt_reference)
register_op("vit3_dwconv_ttt", dwconv_ttt_reference)
register_op("dit5_mlp_ttt", mlp_ttt_reference)
register_op("t5_swiglu_ttt", t5_swiglu_ttt_reference)


def swiglu_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               scale: float, normalize_grad: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """ViT3 SwiGLU inner step + apply; see ``vit3_ttt.reference.swiglu_ttt_reference``."""
    if torch.jit.is_scripting():
        return swiglu_ttt_reference(q, k, v, w1, w2, scale, normalize_grad)
    return get_op("vit3_swiglu_ttt", q.device, backend)(q, k, v, w1, w2, scale, normalize_grad)


def dwconv_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w3: torch.Tensor,
               scale: float, normalize_grad: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """ViT3 3x3 depthwise-conv inner step + apply; see ``vit3_ttt.reference.dwconv_ttt_reference``."""
    if torch.jit.is_scripting():
        return dwconv_ttt_reference(q, k, v, w3, scale, normalize_grad)
    return get_op("vit3_dwconv_ttt", q.device, backend)(q, k, v, w3, scale, normalize_grad)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device
def t5_swiglu_ttt(q, k, v, w1, w2, w3, scale, backend=None):
    """T5 3-matrix SwiGLU inner step + apply; see ``t5_ttt.reference.t5_swiglu_ttt_reference``."""
    return get_op("t5_swiglu_ttt", q.device, backend)(q, k, v, w1, w2, w3, scale)


__all__ = ["available_ops", "get_op", "register_op", "resolve_backend", "swiglu_ttt", "dwconv_ttt",
           "swiglu_ttt_reference", "dwconv_ttt_reference", "mlp_ttt", "mlp_ttt_reference",
           "t5_swiglu_ttt", "t5_swiglu_ttt_reference"]
