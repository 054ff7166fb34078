"""Triton path of the ViT3 inner-loop variants (same ``*_fwd`` / ``*_bwd`` contract as ``torch.py``).

Up to ``backend.MAX_HEAD_DIM["vit3_qkv_fused"]`` the mixer core runs the fused core of ``fused.py`` (both branches,
every inner model, 3 launches forward and 3 backward: ``VariantQKVFused``); above it, the per-branch kernels below
(``VariantQKVTriton``):
Variants 3 / 6 (one linear inner layer) are two kernels, each a single pass over the tokens per (batch, head):
  ``_gram``: fp32 partials of X^T Y over TILES token tiles (G = c k^T v forward; dW' = q^T dO backward);
  ``_xw``:  O = alpha X W (or X W^T) per token tile (out = q S; dq = dO S^T, dk = c v dG^T, dv = c k dG).
Nothing of size N x d x d and no per-token state is written; the d x d algebra (partial sums, N(G), W - lr N(G)
and its backward) runs in PyTorch.  The full SwiGLU and the conv branch reuse ``kernels/vit3_ttt``'s kernels (the
conv step with its own ``lr``); Variant 1's SwiGLU branch runs the lean PyTorch path (``torch.last_fwd``: its four
GEMMs per head are cuBLAS calls), not a dedicated kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import MAX_HEAD_DIM
from ..rope import rope_2d
from ..triton_utils import block_d, jit_sizes, load_mat, load_tile, pid64, prec, store_mat, store_tile, tile_rows, \
    wstrides
from ..utils import autocast_state, no_autocast, reduce_to
from ..vit3_ttt import triton as T3
from ..vit3_ttt.common import rope_in_kernels
from ..vit3_ttt.torch import normalize_columns, normalize_columns_bwd
from . import fused as F
from . import torch as R
from .common import variant_qkv_split

__all__ = ["linear_fwd_triton", "linear_bwd_triton", "conv_fwd_triton", "conv_bwd_triton", "variant_qkv_triton"]

BLOCK_N = 64   # tokens per tile
TILES = 4      # tiles reduced per program in ``_gram``


@jit_sizes
def _gram(X, Y, P, sxb, sxh, sxn, sxd, syb, syh, syn, syd, H, N, D, n_chunks,
          TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """P[pid, chunk] = sum over TILES token tiles of x^T y (fp32, d x d)."""
    pid, chunk = pid64(0), pid64(1)
    b, h = pid // H, pid % H
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    for t in range(TILES):
        offs_n = tile_rows(chunk, t, TILES, BLOCK_N)
        x = load_tile(X, b * sxb + h * sxh, offs_n, offs_d, sxn, sxd, N, D)
        y = load_tile(Y, b * syb + h * syh, offs_n, offs_d, syn, syd, N, D)
        acc += tl.dot(tl.trans(x), y, input_precision=PREC)
    store_mat(P, (pid * n_chunks + chunk) * D * D, acc, offs_d, offs_d, D)


@jit_sizes
def _xw(X, W, O, sxb, sxh, sxn, sxd, swb, swh, swr, swc, sob, soh, son, sod, H, N, D, alpha,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """One token tile of O = alpha X W (W per (batch, head), any strides: W^T by swapped strides)."""
    pid, tile = pid64(0), pid64(1)
    b, h = pid // H, pid % H
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w = load_mat(W, b * swb + h * swh, offs_d, offs_d, swr, swc, D)
    x = load_tile(X, b * sxb + h * sxh, offs_n, offs_d, sxn, sxd, N, D)
    store_tile(O, b * sob + h * soh, tl.dot(x, w, input_precision=PREC) * alpha, offs_n, offs_d, son, sod, N, D)


def gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum_n x_n^T y_n per (batch, head): (B, heads, d, d) fp32."""
    b, h, n, d = x.shape
    chunks = triton.cdiv(n, TILES * BLOCK_N)
    p = torch.empty(b * h, chunks, d, d, device=x.device, dtype=torch.float32)
    _gram[(b * h, chunks)](x, y, p, *x.stride(), *y.stride(), h, n, d, chunks, TILES=TILES, BLOCK_N=BLOCK_N,
                           BLOCK_D=block_d(d), PREC=prec(x.dtype))
    return p.sum(1).reshape(b, h, d, d)


def matmul(x: torch.Tensor, w: torch.Tensor, alpha: float = 1.0, trans: bool = False) -> torch.Tensor:
    """alpha x W (``trans``: x W^T), x (B, heads, N, d), W (1 or B, heads, d, d); a heads-merged output view."""
    b, h, n, d = x.shape
    out = torch.empty(b, n, h, d, device=x.device, dtype=x.dtype).transpose(1, 2)
    sw = wstrides(w)
    if trans:
        sw = (sw[0], sw[1], sw[3], sw[2])
    _xw[(b * h, triton.cdiv(n, BLOCK_N))](x, w, out, *x.stride(), *sw, *out.stride(), h, n, d, float(alpha),
                                          BLOCK_N=BLOCK_N, BLOCK_D=block_d(d), PREC=prec(x.dtype))
    return out


def _check(q, k, v, w1):
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share a (B, heads, N, d) shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, h, _, d = q.shape
    if w1.dim() != 4 or w1.shape[1:] != (h, d, d) or w1.shape[0] not in (1, b):
        raise ValueError(f"w1 must be (1 or B, heads, d, d) = (1 or {b}, {h}, {d}, {d}), got {tuple(w1.shape)}")


# -------------------------------------------------------------------------------- Variants 3 / 6: two kernels
def linear_fwd_triton(q, k, v, w1, w2, scale: float, normalize: bool, lr: float):
    _check(q, k, v, w1)
    g = gram(k, v) * (-scale / k.shape[-2])
    return matmul(q, R._step(w1.float(), g, normalize, lr).contiguous()), g


def linear_bwd_triton(do, q, k, v, w1, w2, g, scale: float, normalize: bool, lr: float):
    c = -scale / k.shape[-2]
    g = g.float()
    s = R._step(w1.float(), g, normalize, lr).contiguous()
    dq = matmul(do, s, trans=True)
    dw1 = gram(q, do)
    dg = R._dg(g, dw1, normalize, lr).contiguous()
    dk, dv = matmul(v, dg, c, trans=True), matmul(k, dg, c)
    return dq, dk, dv, reduce_to(dw1, w1).to(w1.dtype), None


# ------------------------------------------------------------------ full SwiGLU, conv branch: vit3_ttt kernels
def all_fwd_triton(q, k, v, w1, w2, scale: float, normalize: bool, lr: float):
    return T3.swiglu_fwd_triton(q, k, v, w1, w2, scale * lr, normalize)


def all_bwd_triton(do, q, k, v, w1, w2, g, scale: float, normalize: bool, lr: float):
    return T3.swiglu_bwd_triton(do, q, k, v, w1, w2, g, scale * lr, normalize)


def conv_fwd_triton(q, k, v, w3, scale: float, normalize: bool, lr: float):
    b, d, h, w = q.shape
    g = T3._taps_triton(k, v) * (-scale / (h * w))
    w3n = w3.float().reshape(1, d, 3, 3) - lr * (normalize_columns(g, (-2, -1)) if normalize else g)
    return T3._dwconv_triton(q, w3n), g


def conv_bwd_triton(do, q, k, v, w3, g, scale: float, normalize: bool, lr: float):
    b, d, h, w = q.shape
    c = -scale / (h * w)
    g = g.float()
    w3n = w3.float().reshape(1, d, 3, 3) - lr * (normalize_columns(g, (-2, -1)) if normalize else g)
    dq = T3._dwconv_triton(do, w3n.flip(-2, -1)).to(q.dtype)
    dwn = T3._taps_triton(q, do)
    dg = normalize_columns_bwd(g, -lr * dwn, (-2, -1)) if normalize else -lr * dwn
    dk = T3._dwconv_triton(v, dg.flip(-2, -1), c).to(q.dtype)
    dv = T3._dwconv_triton(k, dg, c).to(q.dtype)
    return dq, dk, dv, dwn.sum(0).reshape(d, 1, 3, 3).to(w3.dtype)


BRANCHES = {"all": (all_fwd_triton, all_bwd_triton), "last": (R.last_fwd, R.last_bwd),
            "linear": (linear_fwd_triton, linear_bwd_triton)}
CONV = (conv_fwd_triton, conv_bwd_triton)
VariantQKVTriton = R.make_variant_function("VariantQKVTriton", BRANCHES, CONV)


# ------------------------------------------------------- the fused core: projection views in, 3 + 3 launches
def _rope_parts(cos, sin, in_kernels: bool):
    """((cos, sin) of the split's aten RoPE, (cos, sin) of the kernels): H-ViT3's tables go to one of them
    (``in_kernels``: ``vit3_ttt.common.rope_in_kernels``), (None, None) to the other."""
    return ((None, None), (cos, sin)) if in_kernels else ((cos, sin), (None, None))


def _fused_forward(x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize, kind, lr, share_qk):
    """(out, G, W', G3, W3'): the projection under the caller's autocast, the kernels on its views."""
    glue, tables = _rope_parts(cos, sin, rope_in_kernels(cos, sin, x.shape[-1] // heads))
    (q1, k1, v1), (q2, k2, v2) = variant_qkv_split(x, weight, bias, feat_size, heads, *glue, share_qk)
    with no_autocast(x.device):
        return F.variant_fused_fwd(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale, normalize, kind, lr, *tables)


class VariantQKVFused(torch.autograd.Function):
    """The variant mixer core over ``fused.py`` (3 launches each way): stores x, the weights and the small
    per-(batch, head) tensors; the backward recomputes the projection; H-ViT3's RoPE runs in the kernels (query / key
    cotangents turned back there) or, where they cannot take it, as torch glue (as ``vit3_ttt.ops.QKVFused``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize, kind, lr, share_qk):
        out, *small = _fused_forward(x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize, kind,
                                     lr, share_qk)
        ctx.save_for_backward(x, weight, bias, w1, w2, w3, cos, sin, *small)
        ctx.args = (feat_size, heads, scale, normalize, kind, lr, share_qk)
        ctx.rope_in_kernels = rope_in_kernels(cos, sin, x.shape[-1] // heads)  # the backward turns where it did
        ctx.amp = autocast_state(x.device)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, w1, w2, w3, cos, sin, *small = ctx.saved_tensors
        feat_size, heads, scale, normalize, kind, lr, share_qk = ctx.args
        b, n, c = x.shape
        (gcos, gsin), (tcos, tsin) = _rope_parts(cos, sin, ctx.rope_in_kernels)
        with torch.no_grad(), no_autocast(x.device, *ctx.amp):
            (q1, k1, v1), (q2, k2, v2) = variant_qkv_split(x, weight, bias, feat_size, heads, gcos, gsin, share_qk)
        with torch.no_grad(), no_autocast(x.device):
            dqkv, dw1, dw2, dw3 = F.variant_fused_bwd(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, *small, scale,
                                                      normalize, kind, lr, share_qk, tcos, tsin)
            del q1, k1, v1, q2, k2, v2
            if gcos is not None and gsin is not None:  # RoPE is a rotation: its transpose turns by -angle
                nr = 1 if share_qk else 2  # the rotated rows: (q,) k
                qk = dqkv[..., :nr * c].unflatten(-1, (nr, c)).transpose(1, 2).reshape(b * nr, *feat_size, c)
                dqkv[..., :nr * c] = rope_2d(qk, cos, -sin).reshape(b, nr, n, c).transpose(1, 2).flatten(2)
        with torch.no_grad(), no_autocast(x.device, *ctx.amp):  # projection backward in the forward's precision
            dx = (dqkv @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
            dweight = (dqkv.reshape(-1, dqkv.shape[-1]).t() @ x.reshape(-1, c)).to(weight.dtype)
            dbias = dqkv.sum((0, 1)).to(bias.dtype) if bias is not None else None
        return (dx, dweight, dbias, dw1.to(w1.dtype), None if w2 is None else dw2.to(w2.dtype), dw3.to(w3.dtype)) \
            + (None,) * 9


def _infer_fused(*args):
    return _fused_forward(*args)[0]


def _infer(*args):
    return R.variant_forward(*args, BRANCHES[args[12]] + CONV)[0]


def variant_qkv_triton(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
                       cos=None, sin=None, last_only: bool = False, lr: float = 1.0, share_qk: bool = False,
                       steps: int = 1):
    """Variant mixer core with the Triton kernels (same signature as ``naive.variant_qkv_naive``): the fused core
    (``fused.py``) up to ``MAX_HEAD_DIM["vit3_qkv_fused"]``, the per-branch kernels above it."""
    fused = x.shape[-1] // heads <= MAX_HEAD_DIM["vit3_qkv_fused"]
    return R.run_variant(VariantQKVFused if fused else VariantQKVTriton, _infer_fused if fused else _infer, x, weight,
                         bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos, sin, last_only, lr, share_qk,
                         steps)
