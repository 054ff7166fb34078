"""Triton kernels of the ViT3 inner step per branch (SwiGLU and 3x3 depthwise conv), forward and backward: the
``vit3_swiglu_ttt`` / ``vit3_dwconv_ttt`` ops and ``vit3_variant``'s full SwiGLU and conv branch.  The mixer core
(``vit3_qkv_ttt``) runs both branches together in ``fused.py``.

Same math and the same ``*_fwd`` / ``*_bwd`` contract as ``torch.py`` (which documents the formulas); the
d x d / 3 x 3 algebra between kernels (summing per-chunk partials, column normalisation and its backward, W - G^)
runs in PyTorch on tiny tensors.  Inputs may be any strided view (the qkv split is never copied); loads are upcast
to float32, every product and reduction accumulates in float32 (``tl.dot`` in IEEE fp32 for fp32 inputs, TF32 for
fp16/bf16 inputs), and results are stored in the input dtype.  Nothing of size N x d x d and no per-token weight is
ever written to memory.

SwiGLU branch, per (batch, head) with N tokens of head dim d (D = d padded to a power of two >= 16).  Every kernel
handles one block of output columns of [W1 | W2] (all D when D <= MAX_COLS, else COL_BLOCK); dq and dk sum over the
blocks through fp32 partials (one N x d buffer per block, only when there is more than one):
  fwd kernel 1 ``_swiglu_vjp`` (x = k, y = v): z = k [W1|W2], the SwiGLU derivative and k^T A, fused per token
      tile; each program reduces TILES tiles and writes one fp32 partial of G (2 d^2); partials are summed in PyTorch.
  fwd kernel 2 ``_swiglu_apply``: y = q W', out = y1 silu(y2), fused; reads q once, writes out once.
  bwd kernel 3 ``_swiglu_vjp`` (x = q, y = dO, WRITE_DX): recomputes y = q W', writes dq, reduces dW' = q^T dy
      into partials (the same algebra as kernel 1: dW' = q^T dy is G with k -> q, v -> dO).
  bwd kernel 4 ``_swiglu_update_bwd``: recomputes z = k W, silu, silu', silu'' and A, writes dk and dv, reduces
      dW = k^T dz into partials.
  Saved for backward: q, k, v (the inputs) and G (2 d^2 fp32).  Extra memory per (batch, head): G, the normalised
  W' (2 d^2 each) and the partials (2 d^2 per chunk of TILES * BLOCK_N tokens), all fp32; O(N d) only for the
  output / input gradients themselves.

3x3 depthwise-conv branch, per batch on (pixels x channels) tiles, contiguous along the channels of the token-major
maps (the projection's views):
  ``_taps``: t[i, j] = sum_p xpad[p + (i, j)] e[p] for all 9 taps in one pass over the map (fp32 partials).
  ``_dwconv``: out[p] = sum_taps w[tap] x[p + tap] with zero padding, one pass.
  fwd: G = c taps(k, v); out = dwconv(q, w3 - G^).  bwd (recomputes nothing large, saves only G, 9 floats):
  dq = dwconv(dO, flip(w3')), dW' = taps(q, dO), dk = c dwconv(v, flip(dG)), dv = c dwconv(k, dG).
  Extra memory per (batch, channel): 9 fp32 per chunk of partials plus G and w3' (9 each).
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from . import fused as F
from .torch import normalize_columns, normalize_columns_bwd, step_functions
from ..utils import compute_dtype
from ..triton_utils import block_d as _block_d, jit_sizes, load_mat, load_tile, load_tile_pair, pid64, prec as _prec, \
    store_mat, store_tile, tile_rows, wstrides as _wstrides

__all__ = ["swiglu_fwd_triton", "swiglu_bwd_triton", "dwconv_fwd_triton", "dwconv_bwd_triton", "swiglu_ttt_triton",
           "dwconv_ttt_triton"]

BLOCK_N = 64      # the largest token tile (_reduce_cfg picks the tile per head dim)
TILES = 4         # tiles reduced per program in the reduction kernels
BLOCK_P = 32      # pixels per tile in the conv kernels (tiles of BLOCK_P pixels x fused.BLOCK_CH channels)
MAX_COLS = 64     # widest column block of the d x d SwiGLU kernels; larger (padded) head dims split into blocks
COL_BLOCK = 32    # column-block width used when the padded head dim exceeds MAX_COLS (e.g. d = 72 -> 128 = 4 x 32)


# --------------------------------------------------------------------------------------------- SwiGLU kernels
# Every SwiGLU kernel works on one block of BLOCK_C output columns of W = [W1 | W2] (grid axis 2): the SwiGLU is
# elementwise in the hidden units, so column blocks are independent except for dq / dk, which sum over them (one
# fp32 partial per block, summed in PyTorch).  BLOCK_C = BLOCK_D (one block) for head dims up to 64.
@triton.jit
def _program(H, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """(program, chunk or tile, column block, batch, head, head-dim offsets, column offsets) of this program."""
    pid, chunk, cb = pid64(0), pid64(1), pid64(2)
    return pid, chunk, cb, pid // H, pid % H, tl.arange(0, BLOCK_D), cb * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def _load_pair(W1, W2, base, offs_d, offs_c, sr, sc, D):
    """The column block of two d x d matrices (W1 and W2, or their cotangents)."""
    return load_mat(W1, base, offs_d, offs_c, sr, sc, D), load_mat(W2, base, offs_d, offs_c, sr, sc, D)


@triton.jit
def _store_partials(P1, P2, base, p1, p2, offs_d, offs_c, D):
    """The column block of one program's fp32 partials of the two d x d gradients."""
    store_mat(P1, base, p1, offs_d, offs_c, D)
    store_mat(P2, base, p2, offs_d, offs_c, D)


@triton.jit
def _swiglu_tile(x, w1, w2, PREC: tl.constexpr):
    """z1 = x W1, z2 = x W2 and sigmoid(z2)."""
    z1 = tl.dot(x, w1, input_precision=PREC)
    z2 = tl.dot(x, w2, input_precision=PREC)
    return z1, z2, tl.sigmoid(z2)


@jit_sizes(strides=("sxb", "syb", "sdb"))
def _swiglu_vjp(X, Y, W1, W2, DX, P1, P2,
                sxb, sxh, sxn, sxd, syb, syh, syn, syd, swb, swh, swr, swc, sdc, sdb, sdh, sdn, sdd,
                H, N, D, n_chunks,
                TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                WRITE_DX: tl.constexpr, PREC: tl.constexpr):
    """For ``z1 silu(z2)``, z = x [W1|W2], and its cotangent y: dz = (y silu(z2), y z1 silu'(z2)), reduced over TILES
    tiles into fp32 partials of x^T dz, and (``WRITE_DX``) dx = dz [W1|W2]^T.  Forward update: x = k, y = v
    (partials of G, no dx); backward of the apply: x = q, y = dO, W = W' (partials of dW', dq)."""
    pid, chunk, cb, b, h, offs_d, offs_c = _program(H, BLOCK_D, BLOCK_C)
    w1, w2 = _load_pair(W1, W2, b * swb + h * swh, offs_d, offs_c, swr, swc, D)
    p1, p2 = tl.zeros((BLOCK_D, BLOCK_C), dtype=tl.float32), tl.zeros((BLOCK_D, BLOCK_C), dtype=tl.float32)
    for t in range(TILES):
        offs_n = tile_rows(chunk, t, TILES, BLOCK_N)
        x, y = load_tile_pair(X, Y, b * sxb + h * sxh, b * syb + h * syh, offs_n, offs_d, offs_c, sxn, sxd, syn,
                              syd, N, D)
        z1, z2, s = _swiglu_tile(x, w1, w2, PREC)
        dz1 = y * z2 * s
        dz2 = y * z1 * s * (1.0 + z2 * (1.0 - s))
        if WRITE_DX:
            dx = tl.dot(dz1, tl.trans(w1), input_precision=PREC) + tl.dot(dz2, tl.trans(w2), input_precision=PREC)
            store_tile(DX, cb * sdc + b * sdb + h * sdh, dx, offs_n, offs_d, sdn, sdd, N, D)
        xt = tl.trans(x)
        p1 += tl.dot(xt, dz1, input_precision=PREC)
        p2 += tl.dot(xt, dz2, input_precision=PREC)
    _store_partials(P1, P2, (pid * n_chunks + chunk) * D * D, p1, p2, offs_d, offs_c, D)


@jit_sizes(strides=("sqb", "sob"))
def _swiglu_apply(Q, W1, W2, O,
                  sqb, sqh, sqn, sqd, sob, soh, son, sod,
                  H, N, D,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, PREC: tl.constexpr):
    pid, tile, cb, b, h, offs_d, offs_c = _program(H, BLOCK_D, BLOCK_C)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w1, w2 = _load_pair(W1, W2, pid * D * D, offs_d, offs_c, D, 1, D)
    q = load_tile(Q, b * sqb + h * sqh, offs_n, offs_d, sqn, sqd, N, D)
    y1, y2, s = _swiglu_tile(q, w1, w2, PREC)
    store_tile(O, b * sob + h * soh, y1 * y2 * s, offs_n, offs_c, son, sod, N, D)


@jit_sizes(strides=("skb", "svb", "sdkb", "sdvb"))
def _swiglu_update_bwd(K, V, W1, W2, DG1, DG2, DK, DV, P1, P2,
                       skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swc,
                       sdkc, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
                       H, N, D, n_chunks, c,
                       TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                       PREC: tl.constexpr):
    pid, chunk, cb, b, h, offs_d, offs_c = _program(H, BLOCK_D, BLOCK_C)
    w1, w2 = _load_pair(W1, W2, b * swb + h * swh, offs_d, offs_c, swr, swc, D)
    dg1, dg2 = _load_pair(DG1, DG2, pid * D * D, offs_d, offs_c, D, 1, D)
    dg1, dg2 = dg1 * c, dg2 * c
    dw1, dw2 = tl.zeros((BLOCK_D, BLOCK_C), dtype=tl.float32), tl.zeros((BLOCK_D, BLOCK_C), dtype=tl.float32)
    for t in range(TILES):
        offs_n = tile_rows(chunk, t, TILES, BLOCK_N)
        k, v = load_tile_pair(K, V, b * skb + h * skh, b * svb + h * svh, offs_n, offs_d, offs_c, skn, skd, svn,
                              svd, N, D)
        z1, z2, s = _swiglu_tile(k, w1, w2, PREC)
        silu = z2 * s
        dsilu = s * (1.0 + z2 * (1.0 - s))
        d2silu = s * (1.0 - s) * (2.0 + z2 * (1.0 - 2.0 * s))
        da1 = tl.dot(k, dg1, input_precision=PREC)
        da2 = tl.dot(k, dg2, input_precision=PREC)
        dz1 = da2 * v * dsilu
        dz2 = da1 * v * dsilu + da2 * v * z1 * d2silu
        dk = tl.dot(v * silu, tl.trans(dg1), input_precision=PREC)
        dk += tl.dot(v * z1 * dsilu, tl.trans(dg2), input_precision=PREC)
        dk += tl.dot(dz1, tl.trans(w1), input_precision=PREC)
        dk += tl.dot(dz2, tl.trans(w2), input_precision=PREC)
        store_tile(DK, cb * sdkc + b * sdkb + h * sdkh, dk, offs_n, offs_d, sdkn, sdkd, N, D)
        store_tile(DV, b * sdvb + h * sdvh, da1 * silu + da2 * z1 * dsilu, offs_n, offs_c, sdvn, sdvd, N, D)
        kt = tl.trans(k)
        dw1 += tl.dot(kt, dz1, input_precision=PREC)
        dw2 += tl.dot(kt, dz2, input_precision=PREC)
    _store_partials(P1, P2, (pid * n_chunks + chunk) * D * D, dw1, dw2, offs_d, offs_c, D)


def _check(q, k, v, w1, w2):
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share a (B, heads, N, d) shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, h, _, d = q.shape
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dim() != 4 or w.shape[1:] != (h, d, d) or w.shape[0] not in (1, b):
            raise ValueError(f"{name} must be (1 or B, heads, d, d) = (1 or {b}, {h}, {d}, {d}), got {tuple(w.shape)}")


def _grid_chunks(n: int, bn: int) -> int:
    return triton.cdiv(n, TILES * bn)


def _reduce_cfg(bd: int, dtype: torch.dtype = torch.float32) -> Tuple[int, int]:
    """(token tile, warps) of every SwiGLU kernel: from the sm_90 ptxas reports (experiments/results/sm90_launched.md:
    no spills in fp32, fp16, bf16; an earlier sweep of tiles: 64-token tiles on 4 warps spilled up to 21 KB per
    thread in fp32 at d = 64, and fp16 / bf16 at d = 32 spilled 80 B on 8 warps, none on 4)."""
    if bd <= 32:
        return min(BLOCK_N, 32), (8 if dtype == torch.float32 else 4)
    return min(BLOCK_N, 16), 8


def _block_c(bd: int) -> int:
    return bd if bd <= MAX_COLS else min(COL_BLOCK, bd)


def _heads_merged(b: int, n: int, h: int, d: int, like: torch.Tensor, col_blocks: int):
    """(buffer, view): a (B, N, heads, d) buffer seen as (B, heads, N, d); fp32 partials per column block if > 1."""
    if col_blocks == 1:
        buf = torch.empty(1, b, n, h, d, device=like.device, dtype=like.dtype)
    else:
        buf = torch.empty(col_blocks, b, n, h, d, device=like.device, dtype=torch.float32)
    return buf, buf.transpose(2, 3)


def _merge_col_blocks(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = buf[0] if buf.shape[0] == 1 else buf.sum(0).to(dtype)
    return out.transpose(1, 2)


def swiglu_fwd_triton(q, k, v, w1, w2, scale: float, normalize_grad: bool = True):
    """Triton forward: (out (B, heads, N, d) in q's dtype, raw inner gradient G (B, heads, d, 2d)).

    ``out`` is a transposed view of a (B, N, heads, d) buffer, so merging the heads afterwards is free.
    """
    _check(q, k, v, w1, w2)
    b, h, n, d = q.shape
    bd, prec = _block_d(d), _prec(q.dtype)
    bc, (bn, warps) = _block_c(bd), _reduce_cfg(bd, q.dtype)
    cols, chunks = triton.cdiv(d, bc), _grid_chunks(n, bn)
    p1 = torch.empty(b * h, chunks, d, d, device=q.device, dtype=torch.float32)
    p2 = torch.empty_like(p1)
    _swiglu_vjp[(b * h, chunks, cols)](k, v, w1, w2, p1, p1, p2, *k.stride(), *v.stride(), *_wstrides(w1),
                                       0, 0, 0, 0, 0, h, n, d, chunks, TILES=TILES, BLOCK_N=bn, BLOCK_D=bd,
                                       BLOCK_C=bc, WRITE_DX=False, PREC=prec, num_warps=warps)
    g = torch.cat([p1.sum(1), p2.sum(1)], dim=-1).reshape(b, h, d, 2 * d) * (-scale / n)
    wn = torch.cat([w1, w2], dim=-1).float() - (normalize_columns(g) if normalize_grad else g)
    wn1, wn2 = wn[..., :d].contiguous(), wn[..., d:].contiguous()
    if wn1.shape[0] != b:
        wn1, wn2 = wn1.expand(b, -1, -1, -1).contiguous(), wn2.expand(b, -1, -1, -1).contiguous()
    out = torch.empty(b, n, h, d, device=q.device, dtype=q.dtype).transpose(1, 2)  # heads-merged layout
    _swiglu_apply[(b * h, triton.cdiv(n, bn), cols)](q, wn1, wn2, out, *q.stride(), *out.stride(), h, n, d,
                                                     BLOCK_N=bn, BLOCK_D=bd, BLOCK_C=bc, PREC=prec, num_warps=warps)
    return out, g.to(compute_dtype(q.dtype))


def swiglu_bwd_triton(do, q, k, v, w1, w2, g, scale: float, normalize_grad: bool = True):
    """Triton backward: (dq, dk, dv, dw1, dw2); recomputes every N x d intermediate from q, k, v and G."""
    b, h, n, d = q.shape
    bd, prec = _block_d(d), _prec(q.dtype)
    bc, (bn, warps) = _block_c(bd), _reduce_cfg(bd, q.dtype)
    cols, chunks = triton.cdiv(d, bc), _grid_chunks(n, bn)
    g = g.float()
    w = torch.cat([w1, w2], dim=-1).float()
    wn = w - (normalize_columns(g) if normalize_grad else g)
    if wn.shape[0] != b:
        wn = wn.expand(b, -1, -1, -1)
    wn1, wn2 = wn[..., :d].contiguous(), wn[..., d:].contiguous()
    dq_buf, dq = _heads_merged(b, n, h, d, q, cols)
    p1 = torch.empty(b * h, chunks, d, d, device=q.device, dtype=torch.float32)
    p2 = torch.empty_like(p1)
    _swiglu_vjp[(b * h, chunks, cols)](q, do, wn1, wn2, dq_buf, p1, p2, *q.stride(), *do.stride(), h * d * d, d * d,
                                       d, 1, dq_buf.stride(0), *dq.stride()[1:], h, n, d, chunks, TILES=TILES,
                                       BLOCK_N=bn, BLOCK_D=bd, BLOCK_C=bc, WRITE_DX=True, PREC=prec,
                                       num_warps=warps)
    dwn = torch.cat([p1.sum(1), p2.sum(1)], dim=-1).reshape(b, h, d, 2 * d)
    dg = normalize_columns_bwd(g, -dwn) if normalize_grad else -dwn
    dg1, dg2 = dg[..., :d].contiguous(), dg[..., d:].contiguous()
    dk_buf, dk = _heads_merged(b, n, h, d, q, cols)
    dv = torch.empty(b, n, h, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    _swiglu_update_bwd[(b * h, chunks, cols)](k, v, w1, w2, dg1, dg2, dk_buf, dv, p1, p2, *k.stride(), *v.stride(),
                                              *_wstrides(w1), dk_buf.stride(0), *dk.stride()[1:], *dv.stride(),
                                              h, n, d, chunks, -scale / n,
                                              TILES=TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_C=bc, PREC=prec,
                                              num_warps=warps)
    dq, dk = _merge_col_blocks(dq_buf, q.dtype), _merge_col_blocks(dk_buf, q.dtype)
    dw = dwn + torch.cat([p1.sum(1), p2.sum(1)], dim=-1).reshape(b, h, d, 2 * d)
    if w1.shape[0] == 1:
        dw = dw.sum(0, keepdim=True)
    return dq, dk, dv, dw[..., :d].to(w1.dtype), dw[..., d:].to(w2.dtype)


# ----------------------------------------------------------------------------------------------- conv kernels
# One program per (batch, block of CONV_CH channels) and pixel chunk / tile: 2-D (pixels x channels) tiles, the
# helpers of the fused kernels (``fused._taps_tile`` / ``_conv_tile``: one load per tap, contiguous along the channels
# of the projection's token-major (B, N, 3C + 3d) views, which the per-branch mixer core passes as they are).
CONV_CH: tl.constexpr = tl.constexpr(F.BLOCK_CH)


@jit_sizes(strides=("sxb", "sxc", "sxh", "sxw", "seb", "sec", "seh", "sew"))
def _taps(X, E, P, sxb, sxc, sxh, sxw, seb, sec, seh, sew, C, Hh, Ww, n_chunks, n_cb,
          TILES: tl.constexpr, BLOCK_P: tl.constexpr):
    """Partial t[i, j] = sum_p x[p + (i-1, j-1)] e[p] over TILES pixel tiles: 9 fp32 rows (padded to 16) of CONV_CH
    channels into a (B, chunks, 16, C) buffer."""
    pid, chunk = pid64(0), pid64(1)
    b, cb = pid // n_cb, pid % n_cb
    offs_c = cb * CONV_CH + tl.arange(0, CONV_CH)
    cm = offs_c < C
    acc = tl.zeros((16, CONV_CH), dtype=tl.float32)
    for t in range(TILES):
        y, x, pm = F._conv_rows((chunk * TILES + t) * BLOCK_P, tl.arange(0, BLOCK_P), Hh, Ww)
        acc = F._taps_tile(acc, X, E, b * sxb, b * seb, sxc, sxh, sxw, sec, seh, sew, y, x, pm, offs_c, cm, Hh, Ww)
    tl.store(P + F._taps_ptr(b, chunk, n_chunks, C, tl.arange(0, 16), offs_c), acc, mask=cm[None, :])


@jit_sizes(strides=("sxb", "sxc", "sxh", "sxw", "sob", "soc", "soh", "sow"))
def _dwconv(X, Wt, O, sxb, sxc, sxh, sxw, sob, soc, soh, sow, C, Hh, Ww, n_cb, alpha,
            BLOCK_P: tl.constexpr):
    """out[p] = alpha * sum_taps w[b, c, tap] x[p + tap - 1] (zero padding) on one pixel tile of CONV_CH channels;
    w (B, C, 16) fp32, taps 0..8."""
    pid, tile = pid64(0), pid64(1)
    b, cb = pid // n_cb, pid % n_cb
    offs_c = cb * CONV_CH + tl.arange(0, CONV_CH)
    y, x, pm = F._conv_rows(tile * BLOCK_P, tl.arange(0, BLOCK_P), Hh, Ww)
    F._conv_tile(X, O, b * sxb, b * sob, Wt, b * C * 16, sxc, sxh, sxw, soc, soh, sow, y, x, pm, offs_c, offs_c < C,
                 Hh, Ww, alpha, False)


def _taps_triton(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    chunks, n_cb = triton.cdiv(h * w, TILES * BLOCK_P), triton.cdiv(c, F.BLOCK_CH)
    p = torch.empty(b, chunks, 16, c, device=x.device, dtype=torch.float32)
    _taps[(b * n_cb, chunks)](x, e, p, *x.stride(), *e.stride(), c, h, w, chunks, n_cb, TILES=TILES, BLOCK_P=BLOCK_P)
    return p.sum(1)[:, :9].transpose(1, 2).reshape(b, c, 3, 3)


def _dwconv_triton(x: torch.Tensor, wt: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    b, c, h, w = x.shape
    w16 = torch.zeros(b * c, 16, device=x.device, dtype=torch.float32)
    w16[:, :9] = wt.float().expand(b, c, 3, 3).reshape(b * c, 9)
    out = torch.empty(b, c, h, w, device=x.device, dtype=x.dtype)
    n_cb = triton.cdiv(c, F.BLOCK_CH)
    _dwconv[(b * n_cb, triton.cdiv(h * w, BLOCK_P))](x, w16, out, *x.stride(), *out.stride(), c, h, w, n_cb, alpha,
                                                      BLOCK_P=BLOCK_P)
    return out


def dwconv_fwd_triton(q, k, v, w3, scale: float, normalize_grad: bool = True):
    """Triton forward: (out (B, d, H, W) in q's dtype, raw inner gradient G (B, d, 3, 3) fp32)."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share a (B, d, H, W) shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, d, h, w = q.shape
    if w3.shape != (d, 1, 3, 3):
        raise ValueError(f"w3 must be (d, 1, 3, 3) = ({d}, 1, 3, 3), got {tuple(w3.shape)}")
    g = _taps_triton(k, v) * (-scale / (h * w))
    w3n = w3.float().reshape(1, d, 3, 3) - (normalize_columns(g, (-2, -1)) if normalize_grad else g)
    return _dwconv_triton(q, w3n), g.to(compute_dtype(q.dtype))


def dwconv_bwd_triton(do, q, k, v, w3, g, scale: float, normalize_grad: bool = True):
    """Triton backward: (dq, dk, dv, dw3); every map gradient is one depthwise pass."""
    b, d, h, w = q.shape
    c = -scale / (h * w)
    g = g.float()
    w3n = w3.float().reshape(1, d, 3, 3) - (normalize_columns(g, (-2, -1)) if normalize_grad else g)
    dq = _dwconv_triton(do, w3n.flip(-2, -1)).to(q.dtype)
    dwn = _taps_triton(q, do)
    dg = normalize_columns_bwd(g, -dwn, (-2, -1)) if normalize_grad else -dwn
    dk = _dwconv_triton(v, dg.flip(-2, -1), c).to(q.dtype)
    dv = _dwconv_triton(k, dg, c).to(q.dtype)
    return dq, dk, dv, dwn.sum(0).reshape(d, 1, 3, 3).to(w3.dtype)


# ---------------------------------------------------------------- differentiable entry points (no custom op)
swiglu_ttt_triton, dwconv_ttt_triton = step_functions("Triton", swiglu_fwd_triton, swiglu_bwd_triton,
                                                      dwconv_fwd_triton, dwconv_bwd_triton)
