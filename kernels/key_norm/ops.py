"""The key instance-norm as ``torch.library`` custom ops (``ttt_zoo::key_instance_norm_fwd/bwd``).

Triton kernels where ``backend.use_triton`` allows (CUDA, or CPU under ``TRITON_INTERPRET=1``), the PyTorch
kernels of ``torch.py`` elsewhere, fake (meta) implementations, autograd
through ``register_autograd``:

    y, mean, rstd = torch.ops.ttt_zoo.key_instance_norm_fwd(x, eps)
    dx = torch.ops.ttt_zoo.key_instance_norm_bwd(dy, x, mean, rstd)
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..backend import use_triton
from ..utils import count_flops_as, triton_module
from .torch import check_key_norm, key_norm_bwd, key_norm_fwd

_OP = "key_instance_norm"  # the op name the backend rules (head-dim limit) are looked up under

__all__ = ["key_norm_op"]


def _t():
    return triton_module(__package__)



def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 and not use_triton(x, _OP) else torch.float32


@torch.library.custom_op("ttt_zoo::key_instance_norm_fwd", mutates_args=())
def key_norm_fwd_op(x: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    impl = _t().key_norm_fwd_triton if use_triton(x, _OP) else key_norm_fwd
    y, mean, rstd = impl(x, eps)
    return y.contiguous(), mean.to(_stat_dtype(x)), rstd.to(_stat_dtype(x))


@key_norm_fwd_op.register_fake
def _(x, eps):
    b, n, c = x.shape
    return x.new_empty(b, n, c), x.new_empty(b, c, dtype=_stat_dtype(x)), x.new_empty(b, c, dtype=_stat_dtype(x))


@torch.library.custom_op("ttt_zoo::key_instance_norm_bwd", mutates_args=())
def key_norm_bwd_op(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    impl = _t().key_norm_bwd_triton if use_triton(x, _OP) else key_norm_bwd
    return impl(dy, x, mean, rstd).contiguous()


@key_norm_bwd_op.register_fake
def _(dy, x, mean, rstd):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1], output[2])


def _backward(ctx, dy, *_):
    x, mean, rstd = ctx.saved_tensors
    return key_norm_bwd_op(dy, x, mean, rstd), None


key_norm_fwd_op.register_autograd(_backward, setup_context=_setup)
count_flops_as(key_norm_fwd_op, key_norm_fwd)
count_flops_as(key_norm_bwd_op, key_norm_bwd)


def key_norm_op(x: Tensor, eps: float = 1.0) -> Tensor:
    """Key instance-norm through the custom op (the ``triton`` backend)."""
    check_key_norm(x, eps)
    return key_norm_fwd_op(x, float(eps))[0]
