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

The mixer core's two inner steps together (``fused.py``: 3 Triton launches forward, 3 backward), on the projection's
six views q1, k1, v1 (B, heads, N, d) and q2, k2, v2 (B, d, H, W):

    out, g, wn, g3, wn3 = torch.ops.ttt_zoo.vit3_qkv_fwd(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale,
                                                        normalize_grad, cos, sin, triton)
    dqkv, dw1, dw2, dw3 = torch.ops.ttt_zoo.vit3_qkv_bwd(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, g, wn, g3, wn3,
                                                        scale, normalize_grad, cos, sin, triton)

cos, sin: H-ViT3's 2-D RoPE tables (``rope.rope_2d_tables``) or None; given, q1 and k1 are the unrotated views, the
op turns them (the kernels as they load them) and dqkv holds the cotangents of the unrotated views.

out is (B, N, heads d + d) (heads merged, conv channels last), dqkv (B, N, 3 heads d + 3 d) (the projection's
cotangent); G, W' are (B, heads, d, 2d), G3 (B, d, 3, 3), W3' (B, d, 16) (taps 0..8), all in the compute dtype.
"""
from __future__ import annotations

import importlib
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backend import triton_choice
from ..utils import autocast_state, compute_dtype, count_flops_as, launches_kernel, no_autocast, \
    triton_module
from . import torch as R
from ..rope import rope_2d
from .common import backward_inputs, qkv_split, rope_in_kernels
from .torch import make_qkv_function

__all__ = ["swiglu_ttt_op", "dwconv_ttt_op", "qkv_torch_ops", "qkv_triton_ops", "qkv_fused"]


def _t():
    return triton_module(__package__)


def _f():
    """The fused kernels of the mixer core (``fused.py``), imported on first use."""
    return importlib.import_module(".fused", __package__)


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
    None: the kernels where they can run, ``backend.triton_choice``)."""
    triton = triton_choice(q, "vit3_swiglu_ttt", q.shape[-1]) if triton is None else bool(triton)
    return swiglu_fwd_op(q, k, v, w1, w2, float(scale), bool(normalize_grad), triton)[0]


def dwconv_ttt_op(q, k, v, w3, scale: float, normalize_grad: bool = True, triton=None) -> Tensor:
    """3x3 depthwise-conv inner step + apply through the custom op (the ``triton`` backend; ``triton`` as above)."""
    triton = triton_choice(q, "vit3_dwconv_ttt", q.shape[1]) if triton is None else bool(triton)
    return dwconv_fwd_op(q, k, v, w3, float(scale), bool(normalize_grad), triton)[0]


# ------------------------------------------------------------------------- the mixer core's inner steps, fused
def _rope_heads(t, cos, sin, feat_size):
    """H-ViT3's 2-D RoPE on a (B, heads, N, d) view of the (B, N, C) projection (the op's q1 / k1)."""
    b, heads, n, d = t.shape
    turned = rope_2d(t.transpose(1, 2).reshape(b, feat_size[0], feat_size[1], heads * d), cos, sin)
    return turned.reshape(b, n, heads, d).transpose(1, 2)


def _qkv_fwd_torch(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale, normalize_grad, cos=None, sin=None):
    """The PyTorch path of ``vit3_qkv_fwd`` (same outputs as ``fused.qkv_fused_fwd``)."""
    b, heads, n, d = q1.shape
    if cos is not None and sin is not None:
        q1, k1 = (_rope_heads(t, cos, sin, q2.shape[2:]) for t in (q1, k1))
    dt = compute_dtype(q1.dtype)
    x1, g = R.swiglu_fwd(q1, k1, v1, w1, w2, scale, normalize_grad)
    x2, g3 = R.dwconv_fwd(q2, k2, v2, w3, scale, normalize_grad)
    g, g3 = g.to(dt), g3.to(dt)
    wn = torch.cat([w1, w2], -1).to(dt) - (R.normalize_columns(g) if normalize_grad else g)
    wn3 = w3.to(dt).reshape(1, d, 3, 3) - (R.normalize_columns(g3, (-2, -1)) if normalize_grad else g3)
    out = torch.cat([x1.transpose(1, 2).flatten(2), x2.flatten(2).transpose(1, 2)], -1)
    return out, g, wn.expand(b, -1, -1, -1).contiguous(), g3, F.pad(wn3.flatten(2), (0, 7))


def _qkv_bwd_torch(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, g, wn, g3, wn3, scale, normalize_grad, cos=None,
                   sin=None):
    """The PyTorch path of ``vit3_qkv_bwd`` (same outputs as ``fused.qkv_fused_bwd``)."""
    b, heads, n, d = q1.shape
    c, hh, ww = heads * d, q2.shape[2], q2.shape[3]
    rope = cos is not None and sin is not None
    if rope:
        q1, k1 = (_rope_heads(t, cos, sin, (hh, ww)) for t in (q1, k1))
    do1 = dout[..., :c].unflatten(-1, (heads, d)).transpose(1, 2)
    do2 = dout[..., c:].transpose(1, 2).unflatten(-1, (hh, ww))
    dq1, dk1, dv1, dw1, dw2 = R.swiglu_bwd(do1, q1, k1, v1, w1, w2, g, scale, normalize_grad)
    if rope:  # a rotation's transpose turns by -angle
        dq1, dk1 = (_rope_heads(t, cos, -sin, (hh, ww)) for t in (dq1, dk1))
    dq2, dk2, dv2, dw3 = R.dwconv_bwd(do2, q2, k2, v2, w3, g3, scale, normalize_grad)
    dqkv = torch.cat([t.transpose(1, 2).flatten(2) for t in (dq1, dk1, dv1)]
                     + [t.flatten(2).transpose(1, 2) for t in (dq2, dk2, dv2)], -1).to(q1.dtype)
    dt = compute_dtype(w1.dtype)
    return dqkv, dw1.to(dt).contiguous(), dw2.to(dt).contiguous(), dw3.to(dt).contiguous()


@torch.library.custom_op("ttt_zoo::vit3_qkv_fwd", mutates_args=())
def qkv_fwd_op(q1: Tensor, k1: Tensor, v1: Tensor, q2: Tensor, k2: Tensor, v2: Tensor, w1: Tensor, w2: Tensor,
               w3: Tensor, scale: float, normalize_grad: bool, cos: Optional[Tensor], sin: Optional[Tensor],
               triton: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    impl = _f().qkv_fused_fwd if launches_kernel(triton, q1) else _qkv_fwd_torch
    return impl(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale, normalize_grad, cos, sin)


@qkv_fwd_op.register_fake
def _(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale, normalize_grad, cos, sin, triton):
    b, heads, n, d = q1.shape
    dt = compute_dtype(q1.dtype)
    return (q1.new_empty(b, n, heads * d + d), q1.new_empty(b, heads, d, 2 * d, dtype=dt),
            q1.new_empty(b, heads, d, 2 * d, dtype=dt), q1.new_empty(b, d, 3, 3, dtype=dt),
            q1.new_empty(b, d, 16, dtype=dt))


@torch.library.custom_op("ttt_zoo::vit3_qkv_bwd", mutates_args=())
def qkv_bwd_op(dout: Tensor, q1: Tensor, k1: Tensor, v1: Tensor, q2: Tensor, k2: Tensor, v2: Tensor, w1: Tensor,
               w2: Tensor, w3: Tensor, g: Tensor, wn: Tensor, g3: Tensor, wn3: Tensor, scale: float,
               normalize_grad: bool, cos: Optional[Tensor], sin: Optional[Tensor], triton: bool
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = _f().qkv_fused_bwd if launches_kernel(triton, q1) else _qkv_bwd_torch
    return impl(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, g, wn, g3, wn3, scale, normalize_grad, cos, sin)


@qkv_bwd_op.register_fake
def _(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, g, wn, g3, wn3, scale, normalize_grad, cos, sin, triton):
    b, heads, n, d = q1.shape
    dt = compute_dtype(w1.dtype)
    return (q1.new_empty(b, n, 3 * heads * d + 3 * d), w1.new_empty(w1.shape, dtype=dt),
            w1.new_empty(w1.shape, dtype=dt), w3.new_empty(w3.shape, dtype=dt))


def _qkv_setup(ctx, inputs, output):
    *qkv, w1, w2, w3, scale, normalize_grad, cos, sin, triton = inputs
    ctx.save_for_backward(*qkv, w1, w2, w3, *output[1:], cos, sin)
    ctx.consts, ctx.triton = (scale, normalize_grad), triton


def _qkv_views(dqkv, heads, d, hh, ww):
    """The projection cotangent's six views, shaped as the op's q1, k1, v1, q2, k2, v2."""
    c = heads * d
    return ([dqkv[..., i * c:(i + 1) * c].unflatten(-1, (heads, d)).transpose(1, 2) for i in range(3)]
            + [dqkv[..., 3 * c + i * d:3 * c + (i + 1) * d].transpose(1, 2).unflatten(-1, (hh, ww)) for i in range(3)])


def _qkv_backward(ctx, dout, *_):
    *qkv, w1, w2, w3, g, wn, g3, wn3, cos, sin = ctx.saved_tensors
    dqkv, dw1, dw2, dw3 = qkv_bwd_op(dout, *qkv, w1, w2, w3, g, wn, g3, wn3, *ctx.consts, cos, sin, ctx.triton)
    b, heads, n, d = qkv[0].shape
    return (*_qkv_views(dqkv, heads, d, *qkv[3].shape[2:]), dw1.to(w1.dtype), dw2.to(w2.dtype), dw3.to(w3.dtype),
            None, None, None, None, None)


qkv_fwd_op.register_autograd(_qkv_backward, setup_context=_qkv_setup)
count_flops_as(qkv_fwd_op, _qkv_fwd_torch)
count_flops_as(qkv_bwd_op, _qkv_bwd_torch)


class QKVFused(torch.autograd.Function):
    """The mixer core (projection + both inner steps) over ``vit3_qkv_fwd`` / ``vit3_qkv_bwd``: stores x and the small
    per-(batch, head) tensors; the backward recomputes the projection (one GEMM).  H-ViT3's RoPE runs inside the ops
    (``common.rope_in_kernels``), else as torch glue: on q1, k1 in the split, and back on the (B, N, 2C) slice of their
    cotangents (ViT3 has none)."""

    @staticmethod
    def forward(ctx, x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize_grad, triton,
                recompute=True):
        ctx.rope_in_op = rope_in_kernels(cos, sin, x.shape[-1] // heads)
        glue, tables = ((None, None), (cos, sin)) if ctx.rope_in_op else ((cos, sin), (None, None))
        (q1, k1, v1), (q2, k2, v2) = qkv_split(x, weight, bias, feat_size, heads, *glue)  # the caller's autocast
        with no_autocast(x.device):
            out, *small = qkv_fwd_op(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale, normalize_grad, *tables, triton)
        kept = () if recompute else (q1, k1, v1, q2, k2, v2)  # recompute=False: no projection GEMM in the backward
        ctx.save_for_backward(x, weight, bias, w1, w2, w3, cos, sin, *small, *kept)
        ctx.args = feat_size, heads, scale, normalize_grad, triton
        ctx.amp = autocast_state(x.device)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, w1, w2, w3, cos, sin, *small = ctx.saved_tensors
        small, kept = small[:4], small[4:]
        feat_size, heads, scale, normalize_grad, triton = ctx.args
        b, n, c = x.shape
        glue, tables = ((None, None), (cos, sin)) if ctx.rope_in_op else ((cos, sin), (None, None))
        q1, k1, v1, q2, k2, v2 = backward_inputs(kept, x, weight, bias, feat_size, heads, *glue, ctx.amp)
        del kept
        with torch.no_grad(), no_autocast(x.device):
            dqkv, dw1, dw2, dw3 = qkv_bwd_op(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, *small, scale,
                                             normalize_grad, *tables, triton)
            del q1, k1, v1, q2, k2, v2
            if glue[0] is not None and glue[1] is not None:  # RoPE is a rotation: its transpose turns by -angle
                qk = dqkv[..., :2 * c].unflatten(-1, (2, c)).transpose(1, 2).reshape(b * 2, *feat_size, c)
                dqkv[..., :2 * c] = rope_2d(qk, cos, -sin).reshape(b, 2, n, c).transpose(1, 2).flatten(2)
        with torch.no_grad(), no_autocast(x.device, *ctx.amp):  # projection backward in the forward's precision
            dx = (dqkv @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
            dweight = (dqkv.reshape(-1, dqkv.shape[-1]).t() @ x.reshape(-1, c)).to(weight.dtype)
            dbias = dqkv.sum((0, 1)).to(bias.dtype) if bias is not None else None
        return (dx, dweight, dbias, dw1.to(w1.dtype), dw2.to(w2.dtype), dw3.to(w3.dtype), None, None, None, None,
                None, None, None, None)


def _qkv_function(name: str, triton: bool):
    """The mixer core's autograd.Function over the per-branch custom ops, with the backend choice bound.  The conv
    kernels read the projection's token-major views (their strides): no packed copy of the maps, and one layout,
    so one compiled variant, at every batch (the PyTorch path packs them for its depthwise conv)."""
    return make_qkv_function(name, lambda *a: swiglu_fwd_op(*a, triton), lambda *a: swiglu_bwd_op(*a, triton),
                             lambda *a: dwconv_fwd_op(*a, triton), lambda *a: dwconv_bwd_op(*a, triton),
                             **({"pack": None} if triton else {}))


QKVTorchOps = _qkv_function("QKVTorchOps", False)
QKVTritonOps = _qkv_function("QKVTritonOps", True)  # head dims above backend.MAX_HEAD_DIM["vit3_qkv_fused"]


def _core(function, fused: bool):
    """The mixer core over ``function`` as a plain call (``qkv_ttt_torch``'s signature)."""
    def run(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
            cos=None, sin=None, recompute: bool = True) -> Tensor:
        # feat_size stays symbolic under torch.compile(dynamic=True) (int() would fix it to the traced size)
        args = (x, weight, bias, w1, w2, w3, cos, sin, (feat_size[0], feat_size[1]), int(heads), float(scale),
                bool(normalize_grad))
        return function.apply(*args, True, bool(recompute)) if fused else function.apply(*args, bool(recompute))
    run.__name__ = run.__qualname__ = f"qkv_{function.__name__}"
    return run


#: the mixer-core paths ``vit3_ttt.choose`` picks from: the per-branch custom ops on their PyTorch path (the opaque
#: nodes torch.compile sees for the ``torch`` backend), the per-branch kernels, the fused kernels (3 launches each way)
qkv_torch_ops, qkv_triton_ops, qkv_fused = _core(QKVTorchOps, False), _core(QKVTritonOps, False), _core(QKVFused, True)
