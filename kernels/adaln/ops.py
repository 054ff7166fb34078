"""The adaLN glue as ``torch.library`` custom ops (``ttt_zoo::adaln_*_fwd/bwd``).

Triton kernels when the last argument ``triton`` says so (the caller's one choice, ``backend.resolve_backend``
under the op name ``adaln_modulate``), the PyTorch path of ``torch.py`` otherwise; fake (meta) implementations;
autograd through ``register_autograd`` (the statistics mean, rstd (B, N) are saved, never differentiated):

    h, mean, rstd = torch.ops.ttt_zoo.adaln_modulate_norm_fwd(x, shift, scale, eps, triton)
    dx, dshift, dscale = torch.ops.ttt_zoo.adaln_modulate_norm_bwd(dh, x, mean, rstd, scale, shift_dtype, triton)
    out = torch.ops.ttt_zoo.adaln_gate_residual_fwd(x, y, gate, triton)
    dy, dgate = torch.ops.ttt_zoo.adaln_gate_residual_bwd(g, y, gate, triton)          (dx is g itself)
    x1, h, mean, rstd = torch.ops.ttt_zoo.adaln_gate_residual_modulate_norm_fwd(x, y, gate, shift, scale, eps, triton)
    dx, dy, dgate, dshift, dscale = torch.ops.ttt_zoo.adaln_gate_residual_modulate_norm_bwd(
        g_x1, g_h, x1, y, gate, mean, rstd, scale, x_dtype, shift_dtype, triton)

The (B, C) vectors may be strided views (``mods.unbind(1)``): the kernels take their strides, nothing is copied.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend import triton_choice
from ..utils import count_flops_as, launches_kernel, triton_module
from .naive import adaln_block
from .torch import (check_gate_residual, check_gate_residual_modulate_norm, check_modulate_norm, gate_residual_bwd,
                    gate_residual_fwd, gate_residual_modulate_norm_bwd, gate_residual_modulate_norm_fwd,
                    modulate_norm_bwd, modulate_norm_fwd, out_dtype)

__all__ = ["OP", "modulate_norm", "gate_residual", "gate_residual_modulate_norm", "adaln_block_op",
           "adaln_block_torch"]

OP = "adaln_modulate"


def _t():
    return triton_module(__package__)


def _stat_dtype(x: Tensor, triton: bool) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 and not launches_kernel(triton, x) else torch.float32


def _stats(x: Tensor, mean: Tensor, rstd: Tensor, triton: bool) -> Tuple[Tensor, Tensor]:
    dtype = _stat_dtype(x, triton)
    return mean.to(dtype), rstd.to(dtype)


def _vec_grad(v: Tensor, dtype: torch.dtype) -> Tensor:
    return v.new_empty(v.shape, dtype=dtype)


# ----------------------------------------------------------------------------------------------- modulate_norm
@torch.library.custom_op("ttt_zoo::adaln_modulate_norm_fwd", mutates_args=())
def modulate_norm_fwd_op(x: Tensor, shift: Tensor, scale: Tensor, eps: float,
                         triton: bool) -> Tuple[Tensor, Tensor, Tensor]:
    impl = _t().modulate_norm_fwd_triton if launches_kernel(triton, x) else modulate_norm_fwd
    h, mean, rstd = impl(x, shift, scale, eps)
    return (h.contiguous(), *_stats(x, mean, rstd, triton))


@modulate_norm_fwd_op.register_fake
def _(x, shift, scale, eps, triton):
    b, n, _ = x.shape
    dtype = _stat_dtype(x, triton)
    return (x.new_empty(x.shape, dtype=out_dtype(x, shift, scale)), x.new_empty(b, n, dtype=dtype),
            x.new_empty(b, n, dtype=dtype))


@torch.library.custom_op("ttt_zoo::adaln_modulate_norm_bwd", mutates_args=())
def modulate_norm_bwd_op(dh: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, scale: Tensor, shift_dtype: torch.dtype,
                         triton: bool) -> Tuple[Tensor, Tensor, Tensor]:
    impl = _t().modulate_norm_bwd_triton if launches_kernel(triton, x) else modulate_norm_bwd
    dx, dshift, dscale = impl(dh, x, mean, rstd, scale, shift_dtype)
    return dx.contiguous(), dshift.contiguous(), dscale.contiguous()


@modulate_norm_bwd_op.register_fake
def _(dh, x, mean, rstd, scale, shift_dtype, triton):
    return x.new_empty(x.shape), _vec_grad(scale, shift_dtype), _vec_grad(scale, scale.dtype)


def _mn_setup(ctx, inputs, output):
    x, shift, scale, eps, triton = inputs
    ctx.save_for_backward(x, output[1], output[2], scale)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)
    ctx.shift_dtype, ctx.triton = shift.dtype, triton


def _mn_backward(ctx, dh, *_):
    if dh is None:
        return None, None, None, None, None
    x, mean, rstd, scale = ctx.saved_tensors
    dx, dshift, dscale = modulate_norm_bwd_op(dh, x, mean, rstd, scale, ctx.shift_dtype, ctx.triton)
    return dx, dshift, dscale, None, None


modulate_norm_fwd_op.register_autograd(_mn_backward, setup_context=_mn_setup)
count_flops_as(modulate_norm_fwd_op, modulate_norm_fwd)
count_flops_as(modulate_norm_bwd_op, modulate_norm_bwd)


# ----------------------------------------------------------------------------------------------- gate_residual
@torch.library.custom_op("ttt_zoo::adaln_gate_residual_fwd", mutates_args=())
def gate_residual_fwd_op(x: Tensor, y: Tensor, gate: Tensor, triton: bool) -> Tensor:
    impl = _t().gate_residual_fwd_triton if launches_kernel(triton, x) else gate_residual_fwd
    return impl(x, y, gate).contiguous()


@gate_residual_fwd_op.register_fake
def _(x, y, gate, triton):
    return x.new_empty(x.shape, dtype=out_dtype(x, y, gate))


@torch.library.custom_op("ttt_zoo::adaln_gate_residual_bwd", mutates_args=())
def gate_residual_bwd_op(g: Tensor, y: Tensor, gate: Tensor, triton: bool) -> Tuple[Tensor, Tensor]:
    impl = _t().gate_residual_bwd_triton if launches_kernel(triton, y) else gate_residual_bwd
    dy, dgate = impl(g, y, gate)
    return dy.contiguous(), dgate.contiguous()


@gate_residual_bwd_op.register_fake
def _(g, y, gate, triton):
    return y.new_empty(y.shape), _vec_grad(gate, gate.dtype)


def _gr_setup(ctx, inputs, output):
    x, y, gate, triton = inputs
    ctx.save_for_backward(y, gate)
    ctx.set_materialize_grads(False)
    ctx.x_dtype, ctx.triton = x.dtype, triton


def _gr_backward(ctx, g):
    if g is None:
        return None, None, None, None
    y, gate = ctx.saved_tensors
    need = ctx.needs_input_grad
    dy = dgate = None
    if need[1] or need[2]:
        dy, dgate = gate_residual_bwd_op(g, y, gate, ctx.triton)
    dx = (g if g.dtype == ctx.x_dtype else g.to(ctx.x_dtype)) if need[0] else None
    return dx, dy if need[1] else None, dgate if need[2] else None, None


gate_residual_fwd_op.register_autograd(_gr_backward, setup_context=_gr_setup)
count_flops_as(gate_residual_fwd_op, gate_residual_fwd)
count_flops_as(gate_residual_bwd_op, gate_residual_bwd)


# ---------------------------------------------------------------------------------- gate_residual_modulate_norm
@torch.library.custom_op("ttt_zoo::adaln_gate_residual_modulate_norm_fwd", mutates_args=())
def gate_residual_modulate_norm_fwd_op(x: Tensor, y: Tensor, gate: Tensor, shift: Tensor, scale: Tensor, eps: float,
                                       triton: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = _t().gate_residual_modulate_norm_fwd_triton if launches_kernel(triton, x) \
        else gate_residual_modulate_norm_fwd
    x1, h, mean, rstd = impl(x, y, gate, shift, scale, eps)
    return (x1.contiguous(), h.contiguous(), *_stats(x, mean, rstd, triton))


@gate_residual_modulate_norm_fwd_op.register_fake
def _(x, y, gate, shift, scale, eps, triton):
    b, n, _ = x.shape
    dtype = _stat_dtype(x, triton)
    x1_dtype = out_dtype(x, y, gate)
    return (x.new_empty(x.shape, dtype=x1_dtype),
            x.new_empty(x.shape, dtype=torch.promote_types(x1_dtype, out_dtype(shift, scale))),
            x.new_empty(b, n, dtype=dtype), x.new_empty(b, n, dtype=dtype))


@torch.library.custom_op("ttt_zoo::adaln_gate_residual_modulate_norm_bwd", mutates_args=())
def gate_residual_modulate_norm_bwd_op(g_x1: Optional[Tensor], g_h: Optional[Tensor], x1: Tensor, y: Tensor,
                                       gate: Tensor, mean: Tensor, rstd: Tensor, scale: Tensor, x_dtype: torch.dtype,
                                       shift_dtype: torch.dtype,
                                       triton: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    impl = _t().gate_residual_modulate_norm_bwd_triton if launches_kernel(triton, x1) \
        else gate_residual_modulate_norm_bwd
    grads = impl(g_x1, g_h, x1, y, gate, mean, rstd, scale, x_dtype, shift_dtype)
    return tuple(t.contiguous() for t in grads)


@gate_residual_modulate_norm_bwd_op.register_fake
def _(g_x1, g_h, x1, y, gate, mean, rstd, scale, x_dtype, shift_dtype, triton):
    return (x1.new_empty(x1.shape, dtype=x_dtype), y.new_empty(y.shape), _vec_grad(gate, gate.dtype),
            _vec_grad(scale, shift_dtype), _vec_grad(scale, scale.dtype))


def _grmn_setup(ctx, inputs, output):
    x, y, gate, shift, scale, eps, triton = inputs
    ctx.save_for_backward(output[0], y, gate, output[2], output[3], scale)
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.set_materialize_grads(False)
    ctx.x_dtype, ctx.shift_dtype, ctx.triton = x.dtype, shift.dtype, triton


def _grmn_backward(ctx, g_x1, g_h, *_):
    if g_x1 is None and g_h is None:
        return (None,) * 7
    x1, y, gate, mean, rstd, scale = ctx.saved_tensors
    grads = gate_residual_modulate_norm_bwd_op(g_x1, g_h, x1, y, gate, mean, rstd, scale, ctx.x_dtype,
                                               ctx.shift_dtype, ctx.triton)
    need = ctx.needs_input_grad
    return tuple(g if need[i] else None for i, g in enumerate(grads)) + (None, None)


gate_residual_modulate_norm_fwd_op.register_autograd(_grmn_backward, setup_context=_grmn_setup)
count_flops_as(gate_residual_modulate_norm_fwd_op, gate_residual_modulate_norm_fwd)
count_flops_as(gate_residual_modulate_norm_bwd_op, gate_residual_modulate_norm_bwd)


# -------------------------------------------------------------------------------------------------- public API
def _choice(x: Tensor, triton) -> bool:
    return triton_choice(x, OP, None) if triton is None else bool(triton)


def modulate_norm(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6, triton=None) -> Tensor:
    """``LN(x) * (1 + scale[:, None]) + shift[:, None]`` on (B, N, C) tokens (LayerNorm without affine parameters)
    through the custom op (``triton=False``: its PyTorch path, None: the kernel where it can run,
    ``backend.triton_choice``)."""
    check_modulate_norm(x, shift, scale)
    return modulate_norm_fwd_op(x, shift, scale, float(eps), _choice(x, triton))[0]


def gate_residual(x: Tensor, y: Tensor, gate: Tensor, triton=None) -> Tensor:
    """``x + gate[:, None] * y`` through the custom op (``triton`` as in :func:`modulate_norm`)."""
    check_gate_residual(x, y, gate)
    return gate_residual_fwd_op(x, y, gate, _choice(x, triton))


def gate_residual_modulate_norm(x: Tensor, y: Tensor, gate: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6,
                                triton=None) -> Tuple[Tensor, Tensor]:
    """(x1, h): ``x1 = x + gate * y`` and ``h = modulate_norm(x1, shift, scale)`` in one custom op (``triton`` as in
    :func:`modulate_norm`)."""
    check_gate_residual_modulate_norm(x, y, gate, shift, scale)
    x1, h, _, _ = gate_residual_modulate_norm_fwd_op(x, y, gate, shift, scale, float(eps), _choice(x, triton))
    return x1, h


def adaln_block_op(x: Tensor, y: Tensor, mods: Tensor, eps: float = 1e-6, triton=None) -> Tensor:
    """The three custom ops chained as a DiT block chains them (``naive.adaln_block``): the op's Triton path for
    the registry and the GPU verification."""
    t = _choice(x, triton)
    return adaln_block(lambda *a: modulate_norm(*a, triton=t), lambda *a: gate_residual(*a, triton=t),
                       lambda *a: gate_residual_modulate_norm(*a, triton=t), x, y, mods, eps)


def adaln_block_torch(x: Tensor, y: Tensor, mods: Tensor, eps: float = 1e-6) -> Tensor:
    """:func:`adaln_block_op` on the custom ops' PyTorch path."""
    return adaln_block_op(x, y, mods, eps, triton=False)
