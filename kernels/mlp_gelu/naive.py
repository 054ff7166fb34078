"""Plain GELU vjp (the ``torch_naive`` path and the float64 reference of the tests): autograd through ``F.gelu``."""
from typing import Tuple

import torch
import torch.nn.functional as F

from .torch import check_gelu_vjp

__all__ = ["gelu_vjp_reference", "gelu_linear_reference"]


def gelu_vjp_reference(h: torch.Tensor, dg: torch.Tensor, approximate: str = "none") -> Tuple[torch.Tensor, torch.Tensor]:
    """(gelu(h), dg * gelu'(h)), computed in float64 (float32 for narrower inputs' float32 check: float64 always)."""
    check_gelu_vjp(h, dg, approximate)
    h64 = h.detach().to(torch.float64).requires_grad_()
    with torch.enable_grad():
        g = F.gelu(h64, approximate=approximate)
        (dh,) = torch.autograd.grad(g, h64, dg.to(torch.float64))
    return g.detach().to(h.dtype), dh.to(h.dtype)


def gelu_linear_reference(h: torch.Tensor, weight: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``F.linear(gelu(h), weight)`` in float64 under autograd (the registered reference of ``mlp_gelu``)."""
    out = F.linear(F.gelu(h.to(torch.float64), approximate=approximate), weight.to(torch.float64))
    return out.to(h.dtype)
