"""The MLP's GELU vjp as a ``torch.library`` custom op (``ttt_zoo::mlp_gelu_vjp``): the Triton kernel when the last
argument ``triton`` says so (the caller's one choice, ``backend.resolve_backend``), the PyTorch path otherwise; a fake
(meta) implementation.  No autograd: it runs inside a backward (``layers.recompute``'s ``mid_vjp``).

    g, dh = torch.ops.ttt_zoo.mlp_gelu_vjp(h, dg, approximate, triton)
"""
from typing import Tuple

import torch
from torch import Tensor

from ..backend import triton_choice
from ..utils import launches_kernel, triton_module
from .torch import check_gelu_vjp, gelu_vjp_torch

__all__ = ["OP", "gelu_vjp_op", "gelu_linear_op", "gelu_linear_torch"]

OP = "mlp_gelu"


@torch.library.custom_op("ttt_zoo::mlp_gelu_vjp", mutates_args=())
def _gelu_vjp_op(h: Tensor, dg: Tensor, approximate: str, triton: bool) -> Tuple[Tensor, Tensor]:
    if launches_kernel(triton, h):
        return triton_module(__package__).gelu_vjp_triton(h, dg.to(h.dtype), approximate)
    g, dh = gelu_vjp_torch(h, dg, approximate)
    return g.contiguous(), dh.contiguous()


@_gelu_vjp_op.register_fake
def _(h, dg, approximate, triton):
    return torch.empty_like(h, memory_format=torch.contiguous_format), \
        torch.empty_like(h, memory_format=torch.contiguous_format)


def gelu_vjp_op(h: Tensor, dg: Tensor, approximate: str = "none", triton=None) -> Tuple[Tensor, Tensor]:
    """(gelu(h), dg gelu'(h)) in h's dtype, through the custom op (``triton=None``: the kernel where it can run)."""
    check_gelu_vjp(h, dg, approximate)
    triton = triton_choice(h, OP, None) if triton is None else bool(triton)
    return _gelu_vjp_op(h, dg, approximate, triton)


class _GeluLinear(torch.autograd.Function):
    """``F.linear(gelu(h), weight)`` keeping h only; the backward recomputes gelu(h) with its gradient in one call of
    the op (as ``layers.recompute`` does for the MLPs): the form the GPU verification checks the kernel in."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, approximate: str, triton: bool) -> Tensor:
        ctx.save_for_backward(h, weight)
        ctx.approximate, ctx.triton = approximate, triton
        return torch.nn.functional.linear(torch.nn.functional.gelu(h, approximate=approximate), weight)

    @staticmethod
    def backward(ctx, dy: Tensor):
        h, weight = ctx.saved_tensors
        g, dh = _gelu_vjp_op(h, dy @ weight.to(dy.dtype), ctx.approximate, ctx.triton)
        dw = (dy.reshape(-1, dy.shape[-1]).t() @ g.reshape(-1, g.shape[-1])).to(weight.dtype)
        return dh, dw, None, None


def gelu_linear_op(h: Tensor, weight: Tensor, approximate: str = "tanh", triton: bool = True) -> Tensor:
    """``F.linear(gelu(h), weight)`` with the op in its backward (the registered Triton path of ``mlp_gelu``)."""
    return _GeluLinear.apply(h, weight.to(h.dtype) if weight.dtype != h.dtype else weight, approximate, bool(triton))


def gelu_linear_torch(h: Tensor, weight: Tensor, approximate: str = "tanh") -> Tensor:
    """The same under autograd (the PyTorch path the check compares against)."""
    return torch.nn.functional.linear(torch.nn.functional.gelu(h, approximate=approximate), weight.to(h.dtype))
