"""The key instance-norm as ``torch.library`` custom ops (``ttt_zoo::key_instance_norm_fwd/bwd``).

Triton kernels when the last argument ``triton`` says so (the backend the caller chose once:
``backend.resolve_backend``), the PyTorch kernels of ``torch.py`` otherwise, fake (meta) implementations, autograd
through ``register_autograd``:

    y, mean, rstd = torch.ops.ttt_zoo.key_instance_norm_fwd(x, eps, triton)
    dx = torch.ops.ttt_zoo.key_instance_norm_bwd(dy, x, mean, rstd, triton)
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..backend import triton_choice
from ..utils import count_flops_as, launches_kernel, triton_module
from .torch import check_key_norm, key_norm_bwd, key_norm_fwd

__all__ = ["key_norm_op"]


def _t():
    return triton_module(__package__)



def _stat_dtype(x: Tensor, triton: bool) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 and not launches_kernel(triton, x) else torch.float32


@torch.library.custom_op("ttt_zoo::key_instance_norm_fwd", mutates_args=())
def key_norm_fwd_op(x: Tensor, eps: float, triton: bool) -> Tuple[Tensor, Tensor, Tensor]:
    impl = _t().key_norm_fwd_triton if launches_kernel(triton, x) else key_norm_fwd
    y, mean, rstd = impl(x, eps)
    return y.contiguous(), mean.to(_stat_dtype(x, triton)), rstd.to(_stat_dtype(x, triton))


@key_norm_fwd_op.register_fake
def _(x, eps, triton):
    b, n, c = x.shape
    dtype = _stat_dtype(x, triton)
    return x.new_empty(b, n, c), x.new_empty(b, c, dtype=dtype), x.new_empty(b, c, dtype=dtype)


@torch.library.custom_op("ttt_zoo::key_instance_norm_bwd", mutates_args=())
def key_norm_bwd_op(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, triton: bool) -> Tensor:
    impl = _t().key_norm_bwd_triton if launches_kernel(triton, x) else key_norm_bwd
    return impl(dy, x, mean, rstd).contiguous()


@key_norm_bwd_op.register_fake
def _(dy, x, mean, rstd, triton):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])  # mean, rstd: no cotangents,
    ctx.set_materialize_grads(False)  # and no zero tensor for them
    ctx.triton = inputs[2]


def _backward(ctx, dy, *_):
    if dy is None:
        return None, None, None
    x, mean, rstd = ctx.saved_tensors
    return key_norm_bwd_op(dy, x, mean, rstd, ctx.triton), None, None


key_norm_fwd_op.register_autograd(_backward, setup_context=_setup)
count_flops_as(key_norm_fwd_op, key_norm_fwd)
count_flops_as(key_norm_bwd_op, key_norm_bwd)


def key_norm_op(x: Tensor, eps: float = 1.0, triton=None) -> Tensor:
    """Key instance-norm through the custom op (the ``triton`` backend; ``triton=False``: its PyTorch path, None:
    the kernel where it can run, ``backend.triton_choice``)."""
    check_key_norm(x, eps)
    triton = triton_choice(x, "key_instance_norm", 0) if triton is None else bool(triton)
    return key_norm_fwd_op(x, float(eps), triton)[0]
