"""The key instance-norm as ``torch.library`` custom ops (``ttt_zoo::key_instance_norm_fwd/bwd``).

Triton kernels when the last argument ``triton`` says so (the backend the caller chose once:
``backend.resolve_backend``), the PyTorch kernels of ``torch.py`` otherwise, fake (meta) implementations, autograd
through ``register_autograd``:

    y, mean, rstd = torch.ops.ttt_zoo.key_instance_norm_fwd(x, eps, triton)
    dx = torch.ops.ttt_zoo.key_instance_norm_bwd(dy, x, mean, rstd, triton)
    y, wf, bf, mean, rstd, qc, kc = torch.ops.ttt_zoo.qk_norm_fold_fwd(q, k, eps, wq, bq, wk, bk, triton, copy_qk)
    dq, dk = torch.ops.ttt_zoo.qk_norm_fold_bwd(dy, k, mean, rstd, dqc, dkc, triton)

The third serves the T5 / DiT5 q and k convs as one depthwise conv over [q | key norm(k)] (2C channels): the
Triton kernel writes that buffer and the two convs' stacked taps with the identity folded in, in the key norm's one
launch; its backward is the key norm's (dq, dW, db are slices of the incoming gradients).  With ``copy_qk`` (T5+,
whose neighbourhood attention reads q and k as well) the same launch also writes copies qc, kc of q and k (empty
tensors otherwise) for the attention to read: their gradients then reach this op's backward, which adds them to
dq and dk in the key norm's backward launch (``qk_norm_fold_bwd``) instead of autograd adding them after.

DiT5 (whose q and k pass a per-channel affine first, and whose attention and inner step read v as well) takes the
whole qkv output:

    y, mean, rstd, qc, kc, vc, vt = torch.ops.ttt_zoo.qkv_fold_fwd(qkv, eps, scale, offset, wq, bq, wk, bk, h, w,
                                                                   triton)
    dqkv, dparams = torch.ops.ttt_zoo.qkv_fold_bwd(dy, qkv, mean, rstd, scale, offset, wq, wk, h, w, dqc, dkc, dvc,
                                                   dvt, triton)

The one forward launch applies the affine, the key norm and both residual depthwise convs (with their biases) and
writes [q2 | k2] and copies of q, k, v, v (the neighbourhood attention's q, k, v and the inner step's v); the one
backward launch writes the whole (B, N, 3C) gradient (no add, cat or slice backward after) and per-(sample, channel
block) partial sums of every parameter's gradient (affine, taps, biases), which one sum over the batch reduces in a
fixed order (no atomics).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..backend import triton_choice
from ..utils import count_flops_as, launches_kernel, triton_module
from .torch import (check_key_norm, check_qk_norm_fold, check_qkv_fold, key_norm_bwd, key_norm_fwd, qk_norm_fold_bwd,
                    qk_norm_fold_fwd, qkv_fold_bwd, qkv_fold_fwd)

__all__ = ["key_norm_op", "qk_norm_fold_op", "qkv_fold_op"]


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


@torch.library.custom_op("ttt_zoo::qk_norm_fold_fwd", mutates_args=())
def qk_norm_fold_fwd_op(q: Tensor, k: Tensor, eps: float, wq: Tensor, bq: Tensor, wk: Tensor, bk: Tensor,
                        triton: bool, copy_qk: bool = False
                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    impl = _t().qk_norm_fold_fwd_triton if launches_kernel(triton, k) else qk_norm_fold_fwd
    y, wf, bf, mean, rstd, *copies = impl(q, k, eps, wq, bq, wk, bk, copy_qk)
    dtype = _stat_dtype(k, triton)
    qc, kc = copies or (k.new_empty(0), k.new_empty(0))
    return y.contiguous(), wf.contiguous(), bf.contiguous(), mean.to(dtype), rstd.to(dtype), qc, kc


@qk_norm_fold_fwd_op.register_fake
def _(q, k, eps, wq, bq, wk, bk, triton, copy_qk=False):
    b, n, c = k.shape
    dtype = _stat_dtype(k, triton)
    copies = [k.new_empty((b, n, c) if copy_qk else (0,)) for _ in range(2)]
    return (k.new_empty(b, n, 2 * c), wq.new_empty((2 * c,) + tuple(wq.shape[1:])), bq.new_empty(2 * c),
            k.new_empty(b, c, dtype=dtype), k.new_empty(b, c, dtype=dtype), *copies)


@torch.library.custom_op("ttt_zoo::qk_norm_fold_bwd", mutates_args=())
def qk_norm_fold_bwd_op(dy: Tensor, k: Tensor, mean: Tensor, rstd: Tensor, dqc: Tensor, dkc: Tensor,
                        triton: bool) -> Tuple[Tensor, Tensor]:
    impl = _t().qk_norm_fold_bwd_triton if launches_kernel(triton, k) else qk_norm_fold_bwd
    dq, dk = impl(dy, k, mean, rstd, dqc, dkc)
    return dq.contiguous(), dk.contiguous()


@qk_norm_fold_bwd_op.register_fake
def _(dy, k, mean, rstd, dqc, dkc, triton):
    return k.new_empty(k.shape), k.new_empty(k.shape)


def _fold_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], output[3], output[4])
    ctx.mark_non_differentiable(output[3], output[4])
    ctx.set_materialize_grads(False)
    ctx.triton, ctx.c = inputs[7], inputs[1].shape[-1]


def _fold_backward(ctx, dy, dwf, dbf, dmean, drstd, dqc, dkc):
    """dq and the weights' and biases' gradients are slices of the incoming ones (no launch); dk: the key norm's.
    With the copies' gradients dqc, dkc: one launch adds them to dq and dk (``qk_norm_fold_bwd``)."""
    k, mean, rstd = ctx.saved_tensors
    c = ctx.c
    dq = dk = dwq = dwk = dbq = dbk = None
    if dy is not None and dqc is not None and dkc is not None:
        dq, dk = qk_norm_fold_bwd_op(dy, k, mean, rstd, dqc, dkc, ctx.triton)
    elif dy is not None:
        dq, dk = dy[..., :c], key_norm_bwd_op(dy[..., c:], k, mean, rstd, ctx.triton)
        dq, dk = (dq if dqc is None else dq + dqc), (dk if dkc is None else dk + dkc)
    else:
        dq, dk = dqc, dkc
    if dwf is not None:
        dwq, dwk = dwf[:c], dwf[c:]
    if dbf is not None:
        dbq, dbk = dbf[:c], dbf[c:]
    return dq, dk, None, dwq, dbq, dwk, dbk, None, None


qk_norm_fold_fwd_op.register_autograd(_fold_backward, setup_context=_fold_setup)
count_flops_as(qk_norm_fold_fwd_op, qk_norm_fold_fwd)
count_flops_as(qk_norm_fold_bwd_op, qk_norm_fold_bwd)


def qk_norm_fold_op(q: Tensor, k: Tensor, eps: float, wq: Tensor, bq: Tensor, wk: Tensor, bk: Tensor,
                    triton=None, copy_qk: bool = False) -> Tuple[Tensor, ...]:
    """([q | key norm(k)] (B, N, 2C), stacked conv taps + identity (2C, 1, kh, kw), stacked biases) through the custom
    op (``triton`` as in :func:`key_norm_op`): one depthwise conv of the first with the other two computes both
    residual convs ``q + conv_q(q)``, ``kn + conv_k(kn)``; ``copy_qk``: then copies of q and k (module docstring)."""
    check_qk_norm_fold(q, k, eps, wq, bq, wk, bk)
    triton = triton_choice(k, "key_instance_norm", 0) if triton is None else bool(triton)
    out = qk_norm_fold_fwd_op(q, k, float(eps), wq, bq, wk, bk, triton, bool(copy_qk))
    return out[:3] + (out[5:] if copy_qk else ())


@torch.library.custom_op("ttt_zoo::qkv_fold_fwd", mutates_args=())
def qkv_fold_fwd_op(qkv: Tensor, eps: float, scale: Tensor, offset: Tensor, wq: Tensor, bq: Tensor, wk: Tensor,
                    bk: Tensor, h: int, w: int, triton: bool
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    impl = _t().qkv_fold_fwd_triton if launches_kernel(triton, qkv) else qkv_fold_fwd
    y, mean, rstd, *copies = impl(qkv, eps, scale, offset, wq, bq, wk, bk, h, w)
    dtype = _stat_dtype(qkv, triton)
    return (y.contiguous(), mean.to(dtype), rstd.to(dtype), *(t.contiguous() for t in copies))


@qkv_fold_fwd_op.register_fake
def _(qkv, eps, scale, offset, wq, bq, wk, bk, h, w, triton):
    b, n, c3 = qkv.shape
    c = c3 // 3
    dtype = _stat_dtype(qkv, triton)
    return (qkv.new_empty(b, n, 2 * c), qkv.new_empty(b, c, dtype=dtype), qkv.new_empty(b, c, dtype=dtype),
            *(qkv.new_empty(b, n, c) for _ in range(4)))


@torch.library.custom_op("ttt_zoo::qkv_fold_bwd", mutates_args=())
def qkv_fold_bwd_op(dy: Tensor, qkv: Tensor, mean: Tensor, rstd: Tensor, scale: Tensor, offset: Tensor, wq: Tensor,
                    wk: Tensor, h: int, w: int, dqc: Tensor, dkc: Tensor, dvc: Tensor, dvt: Tensor, triton: bool
                    ) -> Tuple[Tensor, Tensor]:
    """(d qkv, the parameters' gradients flattened into one (R,) tensor in the parameters' dtype, laid out
    [scale | offset | w_q | b_q | w_k | b_k]): the kernel's per-program partial sums reduced over the batch by one
    sum (a fixed order)."""
    impl = _t().qkv_fold_bwd_triton if launches_kernel(triton, qkv) else qkv_fold_bwd
    dqkv, partial = impl(dy, qkv, mean, rstd, scale, offset, wq, wk, h, w, dqc, dkc, dvc, dvt)
    return dqkv.contiguous(), partial.sum(0, dtype=scale.dtype)


@qkv_fold_bwd_op.register_fake
def _(dy, qkv, mean, rstd, scale, offset, wq, wk, h, w, dqc, dkc, dvc, dvt, triton):
    c = qkv.shape[-1] // 3
    return qkv.new_empty(qkv.shape), scale.new_empty(6 * c + 2 * wq.numel())


def _qkv_fold_setup(ctx, inputs, output):
    qkv, _, scale, offset, wq, _, wk, _, h, w, triton = inputs
    ctx.save_for_backward(qkv, scale, offset, wq, wk, output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # no zero tensors for mean, rstd
    ctx.triton, ctx.h, ctx.w = triton, h, w


def _qkv_fold_backward(ctx, dy, dmean, drstd, dqc, dkc, dvc, dvt):
    """d qkv and every parameter's gradient in one launch + one sum; the parameters' gradients are views of that
    sum.  An output not used (no gradient) counts as a zero gradient."""
    qkv, scale, offset, wq, wk, mean, rstd = ctx.saved_tensors
    b, n, c3 = qkv.shape
    c = c3 // 3
    dy = qkv.new_zeros(b, n, 2 * c) if dy is None else dy
    dqc, dkc, dvc, dvt = (qkv.new_zeros(b, n, c) if g is None else g for g in (dqc, dkc, dvc, dvt))
    dqkv, flat = qkv_fold_bwd_op(dy, qkv, mean, rstd, scale, offset, wq, wk, ctx.h, ctx.w, dqc, dkc, dvc, dvt,
                                 ctx.triton)
    ds, do, dwq, dbq, dwk, dbk = torch.split(flat, [2 * c, 2 * c, wq.numel(), c, wk.numel(), c])
    return (dqkv, None, ds.view(scale.shape), do.view(offset.shape), dwq.view(wq.shape), dbq, dwk.view(wk.shape), dbk,
            None, None, None)


qkv_fold_fwd_op.register_autograd(_qkv_fold_backward, setup_context=_qkv_fold_setup)
count_flops_as(qkv_fold_fwd_op, qkv_fold_fwd)
count_flops_as(qkv_fold_bwd_op, qkv_fold_bwd)


def qkv_fold_op(qkv: Tensor, eps: float, scale: Tensor, offset: Tensor, wq: Tensor, bq: Tensor, wk: Tensor,
                bk: Tensor, feat_size: Tuple[int, int], triton=None) -> Tuple[Tensor, ...]:
    """DiT5's ([q2 | k2] (B, N, 2C), copies of q, k, v, v) from the qkv output (B, N, 3C) of the ``feat_size`` map
    through the custom op (``triton`` as in :func:`key_norm_op`; module docstring): q2 = q' + conv_q(q'),
    k2 = kn + conv_k(kn) (the convs with their biases), q' = q s_q + o_q, kn = key norm(k s_k + o_k); the copies
    feed the neighbourhood attention (q, k, v) and the inner step (v)."""
    h, w = (int(t) for t in feat_size)
    check_qkv_fold(qkv, eps, scale, offset, wq, bq, wk, bk, h, w)
    triton = triton_choice(qkv, "key_instance_norm", 0) if triton is None else bool(triton)
    out = qkv_fold_fwd_op(qkv, float(eps), scale, offset, wq, bq, wk, bk, h, w, triton)
    return out[:1] + out[3:]
