"""The T5 / DiT5 inner steps as ``torch.library`` custom ops (``ttt_zoo::t5_*``, ``ttt_zoo::dit5_*``).

Each op runs the Triton kernels when its last argument ``triton`` says so (the backend its caller chose once, under
its own op name: ``backend.resolve_backend``), the recomputing path of ``torch.py`` otherwise, and has a fake (meta) implementation, so ``torch.compile`` sees opaque nodes and meta-device
models build and run.  The forward ops are differentiable through ``register_autograd`` (backward = the ``*_bwd`` op).

    out, w1n, w2n, w3n = torch.ops.ttt_zoo.t5_swiglu_fwd(q, k, v, w1, w2, w3, scale, triton)
    dq, dk, dv, dw1, dw2, dw3 = torch.ops.ttt_zoo.t5_swiglu_bwd(do, q, k, v, w1, w2, w3, w1n, w2n, w3n, scale, triton)
    out, w1n, w2n = torch.ops.ttt_zoo.dit5_mlp_fwd(q, k, v, w1, w2, scale, triton)
    dq, dk, dv, dw1, dw2 = torch.ops.ttt_zoo.dit5_mlp_bwd(do, q, k, v, w1, w2, w1n, w2n, scale, triton)
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from ..backend import triton_choice
from ..utils import compute_dtype, count_flops_as, launches_kernel, triton_module
from . import torch as R

__all__ = ["t5_swiglu_ttt_op", "mlp_ttt_op"]


def _t():
    return triton_module(__package__)



def _fake_fwd(q: Tensor, ws, triton: bool) -> List[Tensor]:
    b, h, n, d = q.shape
    out = q.new_empty(b, n, h, d).transpose(1, 2) if launches_kernel(triton, q) else q.new_empty(b, h, n, d)
    return [out] + [q.new_empty(b, h, d, d, dtype=compute_dtype(q.dtype)) for _ in ws]


def _fake_bwd(q: Tensor, ws, triton: bool) -> List[Tensor]:
    b, h, n, d = q.shape
    if launches_kernel(triton, q):  # the Triton kernels write heads-merged (B, N, heads, d) buffers
        grads = [q.new_empty(b, n, h, d).transpose(1, 2) for _ in range(3)]
    else:
        grads = [q.new_empty(b, h, n, d) for _ in range(3)]
    return grads + [torch.empty_like(w, memory_format=torch.contiguous_format) for w in ws]


def _fwd_impl(q, k, v, ws, scale: float, gated: bool, triton: bool):
    impl = _t().inner_fwd_triton if launches_kernel(triton, q) else R.inner_fwd
    out, wn = impl(q, k, v, ws, scale, gated)
    return (out,) + tuple(w.to(compute_dtype(q.dtype)).contiguous() for w in wn)


def _bwd_impl(do, q, k, v, ws, wn, scale: float, gated: bool, triton: bool):
    kernel = launches_kernel(triton, q)
    grads = (_t().inner_bwd_triton if kernel else R.inner_bwd)(do, q, k, v, ws, wn, scale, gated)
    if kernel:
        return [t if i < 3 else t.contiguous() for i, t in enumerate(grads)]
    return [t.contiguous() for t in grads]


def register_autograd(fwd_op, bwd_op) -> None:
    """``fwd_op(q, k, v, *ws, scale, triton)`` differentiable: saves q, k, v, W and the updated W', the backward
    runs ``bwd_op`` with the forward's ``triton``.  W' is not differentiable and no cotangent is materialised for
    an unused output (no zero tensors); the kernels read a strided ``dout`` as it comes."""
    def setup(ctx, inputs, output):
        *tensors, scale, triton = inputs
        ctx.save_for_backward(*tensors, *output[1:])
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.scale, ctx.triton, ctx.n_inputs = scale, triton, len(inputs)

    def backward(ctx, dout, *_):
        if dout is None:
            return (None,) * ctx.n_inputs
        if not launches_kernel(ctx.triton, dout):
            dout = dout.contiguous()
        return (*bwd_op(dout, *ctx.saved_tensors, ctx.scale, ctx.triton), None, None)

    fwd_op.register_autograd(backward, setup_context=setup)


# ------------------------------------------------------------------------------------------------------ T5
@torch.library.custom_op("ttt_zoo::t5_swiglu_fwd", mutates_args=())
def t5_fwd_op(q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
              scale: float, triton: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _fwd_impl(q, k, v, (w1, w2, w3), scale, True, triton)


@t5_fwd_op.register_fake
def _(q, k, v, w1, w2, w3, scale, triton):
    return tuple(_fake_fwd(q, (w1, w2, w3), triton))


@torch.library.custom_op("ttt_zoo::t5_swiglu_bwd", mutates_args=())
def t5_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, w1n: Tensor,
              w2n: Tensor, w3n: Tensor, scale: float, triton: bool) -> List[Tensor]:
    return _bwd_impl(do, q, k, v, (w1, w2, w3), (w1n, w2n, w3n), scale, True, triton)


@t5_bwd_op.register_fake
def _(do, q, k, v, w1, w2, w3, w1n, w2n, w3n, scale, triton):
    return _fake_bwd(q, (w1, w2, w3), triton)


register_autograd(t5_fwd_op, t5_bwd_op)
count_flops_as(t5_fwd_op, R.t5_fwd)
count_flops_as(t5_bwd_op, R.t5_bwd)


# ---------------------------------------------------------------------------------------------------- DiT5
@torch.library.custom_op("ttt_zoo::dit5_mlp_fwd", mutates_args=())
def dit5_fwd_op(q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor,
                scale: float, triton: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return _fwd_impl(q, k, v, (w1, w2), scale, False, triton)


@dit5_fwd_op.register_fake
def _(q, k, v, w1, w2, scale, triton):
    return tuple(_fake_fwd(q, (w1, w2), triton))


@torch.library.custom_op("ttt_zoo::dit5_mlp_bwd", mutates_args=())
def dit5_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, w1n: Tensor, w2n: Tensor,
                scale: float, triton: bool) -> List[Tensor]:
    return _bwd_impl(do, q, k, v, (w1, w2), (w1n, w2n), scale, False, triton)


@dit5_bwd_op.register_fake
def _(do, q, k, v, w1, w2, w1n, w2n, scale, triton):
    return _fake_bwd(q, (w1, w2), triton)


register_autograd(dit5_fwd_op, dit5_bwd_op)
count_flops_as(dit5_fwd_op, R.dit5_fwd)
count_flops_as(dit5_bwd_op, R.dit5_bwd)


# --------------------------------------------------------------------------------------------- public entry
def t5_swiglu_ttt_op(q, k, v, w1, w2, w3, scale: float, triton=None) -> Tensor:
    """T5 inner step + apply through the custom op (the ``triton`` backend; ``triton=False``: its PyTorch path,
    None: the kernels where they can run, ``backend.triton_choice``)."""
    R._check(q, k, v, (w1, w2, w3), "t5_swiglu_ttt")
    triton = triton_choice(q, "t5_swiglu_ttt", q.shape[-1]) if triton is None else bool(triton)
    return t5_fwd_op(q, k, v, w1, w2, w3, float(scale), triton)[0]


def mlp_ttt_op(q, k, v, w1, w2, scale: float, triton=None) -> Tensor:
    """DiT5 inner step + apply through the custom op (the ``triton`` backend; ``triton`` as above)."""
    R._check(q, k, v, (w1, w2), "dit5_mlp_ttt")
    triton = triton_choice(q, "dit5_mlp_ttt", q.shape[-1]) if triton is None else bool(triton)
    return dit5_fwd_op(q, k, v, w1, w2, float(scale), triton)[0]
