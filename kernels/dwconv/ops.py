"""The residual depthwise 3x3 conv as ``torch.library`` custom ops (``ttt_zoo::residual_dwconv3x3_fwd/bwd``).

Triton kernels when the last argument ``triton`` says so (the caller's one choice, ``backend.resolve_backend``), the
PyTorch path of ``torch.py`` otherwise; fake (meta) implementations; autograd through ``register_autograd``, which
saves x, the weight and the bias only (the backward recomputes the pre-activation):

    y = torch.ops.ttt_zoo.residual_dwconv3x3_fwd(x, weight, bias, H, W, act, triton)
    dx, dweight, dbias = torch.ops.ttt_zoo.residual_dwconv3x3_bwd(dy, x, weight, bias, H, W, act, triton)

``act`` is "none" or "gelu" here (a custom op's string; the Python API takes None | "gelu").
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend import triton_choice
from ..utils import count_flops_as, launches_kernel, triton_module
from .torch import check_residual_dwconv, residual_dwconv_bwd_torch, residual_dwconv_torch

__all__ = ["residual_dwconv_op", "residual_dwconv_vjp", "OP"]

OP = "residual_dwconv3x3"


def _t():
    return triton_module(__package__)


def _act(name: str) -> Optional[str]:
    return None if name == "none" else name


@torch.library.custom_op("ttt_zoo::residual_dwconv3x3_fwd", mutates_args=())
def residual_dwconv_fwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], height: int, width: int, act: str,
                           triton: bool) -> Tensor:
    if launches_kernel(triton, x):
        return _t().residual_dwconv_fwd_triton(x, weight, bias, (height, width), _act(act))
    with torch.no_grad():
        return residual_dwconv_torch(x, weight, bias, (height, width), _act(act)).contiguous()


@residual_dwconv_fwd_op.register_fake
def _(x, weight, bias, height, width, act, triton):
    return x.new_empty(x.shape)


@torch.library.custom_op("ttt_zoo::residual_dwconv3x3_bwd", mutates_args=())
def residual_dwconv_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], pre_x: Optional[Tensor],
                           height: int, width: int, act: str, want_y: bool,
                           triton: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    if launches_kernel(triton, x):
        return _t().residual_dwconv_bwd_triton(dy, x, weight, bias, (height, width), _act(act), want_y, pre_x)
    dx, dw, db = residual_dwconv_bwd_torch(dy, x, weight, bias, (height, width), _act(act), pre_x)
    y = residual_dwconv_torch(x, weight, bias, (height, width), _act(act)).contiguous() if want_y else x.new_empty(0)
    return dx.contiguous(), dw.contiguous(), db.contiguous(), y


@residual_dwconv_bwd_op.register_fake
def _(dy, x, weight, bias, pre_x, height, width, act, want_y, triton):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0]),
            x.new_empty(x.shape if want_y else (0,)))


def _setup(ctx, inputs, output):
    x, weight, bias, height, width, act, triton = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.consts = (height, width, act, triton)


def _backward(ctx, dy):
    x, weight, bias = ctx.saved_tensors
    height, width, act, triton = ctx.consts
    dx, dw, db, _ = residual_dwconv_bwd_op(dy, x, weight, bias, None, height, width, act, False, triton)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dw if need[1] else None, db if bias is not None and need[2] else None,
            None, None, None, None)


residual_dwconv_fwd_op.register_autograd(_backward, setup_context=_setup)


def _flops_fwd(x, weight, bias, height, width, act):
    return residual_dwconv_torch(x, weight, bias, (height, width), _act(act))


count_flops_as(residual_dwconv_fwd_op, _flops_fwd)


def residual_dwconv_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], feat_size: Tuple[int, int],
                       act: Optional[str] = None, triton=None) -> Tensor:
    """``act(x + dwconv3x3(x))`` through the custom op (the ``triton`` backend; ``triton=False``: its PyTorch path,
    None: the kernel where it can run, ``backend.triton_choice``)."""
    check_residual_dwconv(x, weight, bias, feat_size, act)
    triton = triton_choice(x, OP, None) if triton is None else bool(triton)
    return residual_dwconv_fwd_op(x, weight, bias, int(feat_size[0]), int(feat_size[1]), act or "none", triton)


def residual_dwconv_vjp(dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], feat_size: Tuple[int, int],
                        act: Optional[str] = None, pre_x: Optional[Tensor] = None,
                        triton: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, dx, dweight, dbias) of ``y = act(x + dwconv3x3(x))`` in one backward (no autograd): for a caller that
    recomputes y in its backward anyway (``layers.recompute``); the kernels write y as they go.  ``pre_x``: x is
    gelu(pre_x), and dx is the gradient of pre_x (the kernels multiply by gelu'(pre_x) as they store it)."""
    check_residual_dwconv(x, weight, bias, feat_size, act)
    dx, dw, db, y = residual_dwconv_bwd_op(dy.contiguous(), x, weight, bias, pre_x, int(feat_size[0]),
                                           int(feat_size[1]), act or "none", True, bool(triton))
    return y, dx, dw, db
