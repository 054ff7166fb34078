"""The T5 / DiT5 inner steps as ``torch.library`` custom ops (``ttt_zoo::t5_*``, ``ttt_zoo::dit5_*``).

Each op runs the Triton kernels when its last argument ``triton`` says so (the backend its caller chose once, under
its own op name: ``backend.resolve_backend``), the recomputing path of ``torch.py`` otherwise, and has a fake (meta) implementation, so ``torch.compile`` sees opaque nodes and meta-device
models build and run.  The forward ops are differentiable through ``register_autograd`` (backward = the ``*_bwd`` op).

    out, w1n, w2n, w3n = torch.ops.ttt_zoo.t5_swiglu_fwd(q, k, v, w1, w2, w3, scale, triton)
    dq, dk, dv, dw1, dw2, dw3 = torch.ops.ttt_zoo.t5_swiglu_bwd(do, q, k, v, w1, w2, w3, w1n, w2n, w3n, scale, triton)
    out, w1n, w2n = torch.ops.ttt_zoo.dit5_mlp_fwd(q, k, v, w1, w2, scale, triton)
    dq, dk, dv, dw1, dw2 = torch.ops.ttt_zoo.dit5_mlp_bwd(do, q, k, v, w1, w2, w1n, w2n, scale, triton)

Stacked q and k (``k=None``): ``q`` is (2, B, heads, N, d), q and k as one view of the conv that computed both
(T5 / DiT5's fused q / k conv): the backward returns their gradient as one tensor (written by the two kernels that
compute dq and dk), so autograd needs no ``cat`` to merge them; the backward op then returns it first, no dk.

Optional blend (T5+ / DiT5's 0.5 TTT + 0.5 NA): the forward ops take ``mix`` (B, heads, N, d, any strides) and
``mix_weight`` a after ``triton`` and return out = (1 - a) apply + a mix (the Triton apply kernel writes the blend);
the backward ops take ``mix_weight`` and ``has_mix`` and then return d mix = a dO last (written by ``_bwd_apply``,
which scales dO by 1 - a).  The PyTorch path blends with one ``torch.lerp``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..backend import triton_choice
from ..utils import compute_dtype, count_flops_as, launches_kernel, triton_module
from . import torch as R

__all__ = ["t5_swiglu_ttt_op", "mlp_ttt_op"]


def _t():
    return triton_module(__package__)



def _split_qk(q: Tensor, k: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """q and k of the ops' inputs: ``k`` None: ``q`` stacks them (2, B, heads, N, d)."""
    return (q[0], q[1]) if k is None else (q, k)


def _stacked_grad(q: Tensor, triton: bool) -> Tensor:
    """The gradient of stacked q, k (2, B, heads, N, d): heads-merged (B, N, 2, heads, d) memory where the kernels
    write it, so that it is a view of the conv output's (B, N, 2C) gradient."""
    _, b, h, n, d = q.shape
    return q.new_empty(b, n, 2, h, d).permute(2, 0, 3, 1, 4) if launches_kernel(triton, q) else q.new_empty(q.shape)


def _fake_fwd(q: Tensor, ws, triton: bool) -> List[Tensor]:
    b, h, n, d = q.shape
    out = q.new_empty(b, n, h, d).transpose(1, 2) if launches_kernel(triton, q) else q.new_empty(b, h, n, d)
    return [out] + [q.new_empty(b, h, d, d, dtype=compute_dtype(q.dtype)) for _ in ws]


def _fake_bwd(q: Tensor, k: Optional[Tensor], ws, triton: bool, has_mix: bool = False) -> List[Tensor]:
    stacked = [_stacked_grad(q, triton)] if k is None else []
    q = q[0] if k is None else q
    b, h, n, d = q.shape
    if launches_kernel(triton, q):  # the Triton kernels write heads-merged (B, N, heads, d) buffers
        grads = [q.new_empty(b, n, h, d).transpose(1, 2) for _ in range(3 - 2 * len(stacked))]
    else:
        grads = [q.new_empty(b, h, n, d) for _ in range(3 - 2 * len(stacked))]
    grads = stacked + grads
    dmix = [torch.empty_like(grads[-1])] if has_mix else []
    return grads + [torch.empty_like(w, memory_format=torch.contiguous_format) for w in ws] + dmix


def _check_mix(q: Tensor, mix: Optional[Tensor]) -> None:
    if mix is not None and (mix.shape != q.shape or mix.dtype != q.dtype or mix.device != q.device):
        raise ValueError(f"mix must match q's shape, dtype and device {tuple(q.shape)}, {q.dtype}, {q.device}; got "
                         f"{tuple(mix.shape)}, {mix.dtype}, {mix.device}")


def _fwd_impl(q, k, v, ws, scale: float, gated: bool, triton: bool, mix: Optional[Tensor], mix_weight: float):
    q, k = _split_qk(q, k)
    if launches_kernel(triton, q):
        out, wn = _t().inner_fwd_triton(q, k, v, ws, scale, gated, mix, mix_weight)
    else:
        out, wn = R.inner_fwd(q, k, v, ws, scale, gated)
        if mix is not None:  # (1 - a) out + a mix, in place: out keeps the layout the fake promises
            out = out.lerp_(mix, mix_weight)
    return (out,) + tuple(w.to(compute_dtype(q.dtype)).contiguous() for w in wn)


def _bwd_impl(do, q, k, v, ws, wn, scale: float, gated: bool, triton: bool, mix_weight: float, has_mix: bool):
    dqk = _stacked_grad(q, triton) if k is None else None  # dq, dk written into its two halves
    q, k = _split_qk(q, k)
    if launches_kernel(triton, q):  # the kernel scales dO and writes d mix (last)
        grads = _t().inner_bwd_triton(do, q, k, v, ws, wn, scale, gated, mix_weight if has_mix else None, dqk)
        grads = [t if i < 3 or (has_mix and i == len(grads) - 1) else t.contiguous() for i, t in enumerate(grads)]
    else:
        dmix = []
        if has_mix:
            dmix, do = [do * mix_weight], do * (1.0 - mix_weight)
        grads = [t.contiguous() for t in R.inner_bwd(do, q, k, v, ws, wn, scale, gated)] + dmix
        if dqk is not None:
            dqk[0], dqk[1] = grads[0], grads[1]
    return grads if dqk is None else [dqk] + grads[2:]


def register_autograd(fwd_op, bwd_op, n_weights: int) -> None:
    """``fwd_op(q, k, v, *ws, scale, triton, mix, mix_weight)`` differentiable: saves q, k, v, W and the updated W',
    the backward runs ``bwd_op`` with the forward's ``triton`` (and returns d mix when a ``mix`` was blended in).
    W' is not differentiable and no cotangent is materialised for an unused output (no zero tensors); the kernels
    read a strided ``dout`` as it comes."""
    n_t = 3 + n_weights

    def setup(ctx, inputs, output):
        scale, triton, mix, mix_weight = inputs[n_t:]
        ctx.save_for_backward(*inputs[:n_t], *output[1:])
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.scale, ctx.triton, ctx.mix_weight, ctx.has_mix = scale, triton, mix_weight, mix is not None
        ctx.stacked = inputs[1] is None

    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * (n_t + 4)
        if not launches_kernel(ctx.triton, dout):
            dout = dout.contiguous()
        grads = bwd_op(dout, *ctx.saved_tensors, ctx.scale, ctx.triton, ctx.mix_weight, ctx.has_mix)
        if ctx.stacked:  # one gradient for the stacked q, k; none for the absent k
            grads = [grads[0], None] + list(grads[1:])
        return (*grads[:n_t], None, None, grads[n_t] if ctx.has_mix else None, None)

    fwd_op.register_autograd(backward, setup_context=setup)


# ------------------------------------------------------------------------------------------------------ T5
@torch.library.custom_op("ttt_zoo::t5_swiglu_fwd", mutates_args=())
def t5_fwd_op(q: Tensor, k: Optional[Tensor], v: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, scale: float, triton: bool,
              mix: Optional[Tensor] = None, mix_weight: float = 0.0) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _fwd_impl(q, k, v, (w1, w2, w3), scale, True, triton, mix, mix_weight)


@t5_fwd_op.register_fake
def _(q, k, v, w1, w2, w3, scale, triton, mix=None, mix_weight=0.0):
    return tuple(_fake_fwd(_split_qk(q, k)[0], (w1, w2, w3), triton))


@torch.library.custom_op("ttt_zoo::t5_swiglu_bwd", mutates_args=())
def t5_bwd_op(do: Tensor, q: Tensor, k: Optional[Tensor], v: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, w1n: Tensor,
              w2n: Tensor, w3n: Tensor, scale: float, triton: bool, mix_weight: float = 0.0,
              has_mix: bool = False) -> List[Tensor]:
    return _bwd_impl(do, q, k, v, (w1, w2, w3), (w1n, w2n, w3n), scale, True, triton, mix_weight, has_mix)


@t5_bwd_op.register_fake
def _(do, q, k, v, w1, w2, w3, w1n, w2n, w3n, scale, triton, mix_weight=0.0, has_mix=False):
    return _fake_bwd(q, k, (w1, w2, w3), triton, has_mix)


register_autograd(t5_fwd_op, t5_bwd_op, 3)
count_flops_as(t5_fwd_op, lambda q, k, v, w1, w2, w3, scale, *_: R.t5_fwd(*_split_qk(q, k), v, w1, w2, w3, scale))
count_flops_as(t5_bwd_op, lambda do, q, k, *a: R.t5_bwd(do, *_split_qk(q, k), *a[:8]))


# ---------------------------------------------------------------------------------------------------- DiT5
@torch.library.custom_op("ttt_zoo::dit5_mlp_fwd", mutates_args=())
def dit5_fwd_op(q: Tensor, k: Optional[Tensor], v: Tensor, w1: Tensor, w2: Tensor, scale: float, triton: bool,
                mix: Optional[Tensor] = None, mix_weight: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    return _fwd_impl(q, k, v, (w1, w2), scale, False, triton, mix, mix_weight)


@dit5_fwd_op.register_fake
def _(q, k, v, w1, w2, scale, triton, mix=None, mix_weight=0.0):
    return tuple(_fake_fwd(_split_qk(q, k)[0], (w1, w2), triton))


@torch.library.custom_op("ttt_zoo::dit5_mlp_bwd", mutates_args=())
def dit5_bwd_op(do: Tensor, q: Tensor, k: Optional[Tensor], v: Tensor, w1: Tensor, w2: Tensor, w1n: Tensor, w2n: Tensor,
                scale: float, triton: bool, mix_weight: float = 0.0, has_mix: bool = False) -> List[Tensor]:
    return _bwd_impl(do, q, k, v, (w1, w2), (w1n, w2n), scale, False, triton, mix_weight, has_mix)


@dit5_bwd_op.register_fake
def _(do, q, k, v, w1, w2, w1n, w2n, scale, triton, mix_weight=0.0, has_mix=False):
    return _fake_bwd(q, k, (w1, w2), triton, has_mix)


register_autograd(dit5_fwd_op, dit5_bwd_op, 2)
count_flops_as(dit5_fwd_op, lambda q, k, v, w1, w2, scale, *_: R.dit5_fwd(*_split_qk(q, k), v, w1, w2, scale))
count_flops_as(dit5_bwd_op, lambda do, q, k, *a: R.dit5_bwd(do, *_split_qk(q, k), *a[:6]))


# --------------------------------------------------------------------------------------------- public entry
def t5_swiglu_ttt_op(q, k, v, w1, w2, w3, scale: float, triton=None, mix: Optional[Tensor] = None,
                     mix_weight: float = 0.0) -> Tensor:
    """T5 inner step + apply through the custom op (the ``triton`` backend; ``triton=False``: its PyTorch path,
    None: the kernels where they can run, ``backend.triton_choice``); ``mix``: (1 - mix_weight) out + mix_weight mix
    in the same op; ``k=None``: ``q`` stacks q and k (2, B, heads, N, d), module docstring."""
    q1, k1 = _split_qk(q, k)
    R._check(q1, k1, v, (w1, w2, w3), "t5_swiglu_ttt")
    _check_mix(q1, mix)
    triton = triton_choice(q1, "t5_swiglu_ttt", q1.shape[-1]) if triton is None else bool(triton)
    return t5_fwd_op(q, k, v, w1, w2, w3, float(scale), triton, mix, float(mix_weight))[0]


def mlp_ttt_op(q, k, v, w1, w2, scale: float, triton=None, mix: Optional[Tensor] = None,
               mix_weight: float = 0.0) -> Tensor:
    """DiT5 inner step + apply through the custom op (the ``triton`` backend; ``triton``, ``mix`` as above)."""
    q1, k1 = _split_qk(q, k)
    R._check(q1, k1, v, (w1, w2), "dit5_mlp_ttt")
    _check_mix(q1, mix)
    triton = triton_choice(q1, "dit5_mlp_ttt", q1.shape[-1]) if triton is None else bool(triton)
    return dit5_fwd_op(q, k, v, w1, w2, float(scale), triton, mix, float(mix_weight))[0]
