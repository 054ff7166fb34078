"""The ViT3 inner-step primitives as ``torch.library`` custom ops (``ttt_zoo::vit3_*``).

Each op runs the Triton kernels when its last argument ``triton`` says so (the backend its caller chose once, under
its own op name: ``backend.resolve_backend``), the recomputing path of ``torch.py`` otherwise, and has a fake (meta)
implementation giving output shapes, dtypes and strides, so that ``torch.compile`` treats the ops as opaque nodes
and meta-device models build and run.  The forward ops are differentiable through ``register_autograd`` (their
backward is the matching ``*_bwd`` op, with the forward's ``triton``).

    out, g = torch.ops.ttt_zoo.vit3_swiglu_fwd(q, k, v, w1, w2, scale, normalize_grad, triton)
    dq, dk, dv, dw1, dw2 = torch.ops.ttt_zoo.vit3_swiglu_bwd(do, q, k, v, w1, w2, g, scale, normalize_grad, triton)
    out, g = torch.ops.ttt_zoo.vit3_dwconv_fwd(q, k, v, w3, scale, normalize_grad, triton)
    dq, dk, dv, dw3 = torch.ops.ttt_zoo.vit3_dwconv_bwd(do, q, k, v, w3, g, scale, normalize_grad, triton)
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from ..utils import compute_dtype, count_flops_as, kernel_choice, launches_kernel, triton_module
from . import torch as R
from .torch import make_qkv_function

__all__ = ["swiglu_ttt_op", "dwconv_ttt_op", "qkv_ttt_op"]


def _t():
    return triton_module(__package__)



# --------------------------------------------------------------------------------------------------- SwiGLU
@torch.library.custom_op("ttt_zoo::vit3_swiglu_fwd", mutates_args=())
def swiglu_fwd_op(q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, scale: float,
                  normalize_grad: bool, triton: bool) -> Tuple[Tensor, Tensor]:
    impl = _t().swiglu_fwd_triton if launches_kernel(triton, q) else R.swiglu_fwd
    return impl(q, k, v, w1, w2, scale, normalize_grad)


@swiglu_fwd_op.register_fake
def _(q, k, v, w1, w2, scale, normalize_grad, triton):
    b, h, n, d = q.shape
    if launches_kernel(triton, q):  # the Triton kernel writes a heads-merged (B, N, heads, d) buffer
        out = q.new_empty(b, n, h, d).transpose(1, 2)
    else:
        out = q.new_empty(b, h, n, d)
    return out, q.new_empty(b, h, d, 2 * d, dtype=compute_dtype(q.dtype))


@torch.library.custom_op("ttt_zoo::vit3_swiglu_bwd", mutates_args=())
def swiglu_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, g: Tensor, scale: float,
                  normalize_grad: bool, triton: bool) -> List[Tensor]:
    if launches_kernel(triton, q):  # dq, dk, dv in the kernels' heads-merged layout
        grads = _t().swiglu_bwd_triton(do, q, k, v, w1, w2, g, scale, normalize_grad)
        return [t.contiguous() if i > 2 else t for i, t in enumerate(grads)]
    return [t.contiguous() for t in R.swiglu_bwd(do, q, k, v, w1, w2, g, scale, normalize_grad)]


@swiglu_bwd_op.register_fake
def _(do, q, k, v, w1, w2, g, scale, normalize_grad, triton):
    b, h, n, d = q.shape
    if launches_kernel(triton, q):
        grads = [q.new_empty(b, n, h, d).transpose(1, 2) for _ in range(3)]
    else:
        grads = [q.new_empty(b, h, n, d) for _ in range(3)]
    return grads + [torch.empty_like(w1, memory_format=torch.contiguous_format),
                    torch.empty_like(w2, memory_format=torch.contiguous_format)]


def _swiglu_setup(ctx, inputs, output):
    q, k, v, w1, w2, scale, normalize_grad, triton = inputs
    ctx.save_for_backward(q, k, v, w1, w2, output[1])
    ctx.scale, ctx.normalize_grad, ctx.triton = scale, normalize_grad, triton


def _swiglu_backward(ctx, dout, dg):
    q, k, v, w1, w2, g = ctx.saved_tensors
    grads = swiglu_bwd_op(dout.contiguous(), q, k, v, w1, w2, g, ctx.scale, ctx.normalize_grad, ctx.triton)
    return (*grads, None, None, None)


swiglu_fwd_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)
count_flops_as(swiglu_fwd_op, R.swiglu_fwd)
count_flops_as(swiglu_bwd_op, R.swiglu_bwd)


# ----------------------------------------------------------------------------------------------------- conv
@torch.library.custom_op("ttt_zoo::vit3_dwconv_fwd", mutates_args=())
def dwconv_fwd_op(q: Tensor, k: Tensor, v: Tensor, w3: Tensor, scale: float,
                  normalize_grad: bool, triton: bool) -> Tuple[Tensor, Tensor]:
    impl = _t().dwconv_fwd_triton if launches_kernel(triton, q) else R.dwconv_fwd
    return impl(q, k, v, w3, scale, normalize_grad)


@dwconv_fwd_op.register_fake
def _(q, k, v, w3, scale, normalize_grad, triton):
    b, d, h, w = q.shape
    return q.new_empty(b, d, h, w), q.new_empty(b, d, 3, 3, dtype=compute_dtype(q.dtype))


@torch.library.custom_op("ttt_zoo::vit3_dwconv_bwd", mutates_args=())
def dwconv_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, w3: Tensor, g: Tensor, scale: float,
                  normalize_grad: bool, triton: bool) -> List[Tensor]:
    impl = _t().dwconv_bwd_triton if launches_kernel(triton, q) else R.dwconv_bwd
    return [t.contiguous() for t in impl(do, q, k, v, w3, g, scale, normalize_grad)]


@dwconv_bwd_op.register_fake
def _(do, q, k, v, w3, g, scale, normalize_grad, triton):
    b, d, h, w = q.shape
    return [q.new_empty(b, d, h, w) for _ in range(3)] + [torch.empty_like(w3, memory_format=torch.contiguous_format)]


def _dwconv_setup(ctx, inputs, output):
    q, k, v, w3, scale, normalize_grad, triton = inputs
    ctx.save_for_backward(q, k, v, w3, output[1])
    ctx.scale, ctx.normalize_grad, ctx.triton = scale, normalize_grad, triton


def _dwconv_backward(ctx, dout, dg):
    q, k, v, w3, g = ctx.saved_tensors
    grads = dwconv_bwd_op(dout.contiguous(), q, k, v, w3, g, ctx.scale, ctx.normalize_grad, ctx.triton)
    return (*grads, None, None, None)


dwconv_fwd_op.register_autograd(_dwconv_backward, setup_context=_dwconv_setup)
count_flops_as(dwconv_fwd_op, R.dwconv_fwd)
count_flops_as(dwconv_bwd_op, R.dwconv_bwd)


# --------------------------------------------------------------------------------------------- public entry
def swiglu_ttt_op(q, k, v, w1, w2, scale: float, normalize_grad: bool = True, triton=None) -> Tensor:
    """SwiGLU inner step + apply through the custom op (the ``triton`` backend; ``triton=False``: its PyTorch path,
    None: the kernels where they can run, ``utils.kernel_choice``)."""
    triton = kernel_choice(triton, q, "vit3_swiglu_ttt", q.shape[-1])
    return swiglu_fwd_op(q, k, v, w1, w2, float(scale), bool(normalize_grad), triton)[0]


def dwconv_ttt_op(q, k, v, w3, scale: float, normalize_grad: bool = True, triton=None) -> Tensor:
    """3x3 depthwise-conv inner step + apply through the custom op (the ``triton`` backend; ``triton`` as above)."""
    triton = kernel_choice(triton, q, "vit3_dwconv_ttt", q.shape[1])
    return dwconv_fwd_op(q, k, v, w3, float(scale), bool(normalize_grad), triton)[0]


def _qkv_function(name: str, triton: bool):
    """The mixer core's autograd.Function over the custom ops, with the backend choice bound."""
    return make_qkv_function(name, lambda *a: swiglu_fwd_op(*a, triton), lambda *a: swiglu_bwd_op(*a, triton),
                             lambda *a: dwconv_fwd_op(*a, triton), lambda *a: dwconv_bwd_op(*a, triton))


QKVTTTOps = {True: _qkv_function("QKVTTTOps", True), False: _qkv_function("QKVTorchOps", False)}


def qkv_ttt_op(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
               cos=None, sin=None, triton=None) -> Tensor:
    """ViT3 mixer core (projection + both inner steps) whose inner steps are the custom ops (``triton=False``:
    their PyTorch path, the opaque nodes torch.compile sees for the ``torch`` backend; None: as ``swiglu_ttt_op``)."""
    triton = kernel_choice(triton, x, "vit3_qkv_ttt", x.shape[-1] // heads)
    # feat_size stays symbolic under torch.compile(dynamic=True) (int() would fix it to the traced size)
    return QKVTTTOps[triton].apply(x, weight, bias, w1, w2, w3, cos, sin, (feat_size[0], feat_size[1]),
                                         int(heads), float(scale), bool(normalize_grad))

