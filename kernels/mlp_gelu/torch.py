"""The PyTorch path of the MLP's GELU vjp: ``F.gelu`` and aten's ``gelu_backward`` (two launches)."""
from typing import Tuple

import torch
import torch.nn.functional as F

__all__ = ["check_gelu_vjp", "gelu_vjp_torch", "APPROXIMATIONS"]

APPROXIMATIONS = ("none", "tanh")


def check_gelu_vjp(h: torch.Tensor, dg: torch.Tensor, approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"gelu_vjp: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if h.shape != dg.shape:
        raise ValueError(f"gelu_vjp: h and dg must have one shape, got {tuple(h.shape)} and {tuple(dg.shape)}")
    if not (h.is_floating_point() and dg.is_floating_point()):
        raise ValueError(f"gelu_vjp: floating-point h and dg expected, got {h.dtype} and {dg.dtype}")


def gelu_vjp_torch(h: torch.Tensor, dg: torch.Tensor, approximate: str = "none") -> Tuple[torch.Tensor, torch.Tensor]:
    """(gelu(h), dg * gelu'(h)) in h's dtype."""
    check_gelu_vjp(h, dg, approximate)
    dg = dg.to(h.dtype)
    return F.gelu(h, approximate=approximate), torch.ops.aten.gelu_backward(dg, h, approximate=approximate)
