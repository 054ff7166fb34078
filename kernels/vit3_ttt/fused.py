"""The ViT3 mixer core's inner steps (SwiGLU branch and 3x3 depthwise-conv branch together) in 3 Triton launches
forward and 3 backward.  Same math as ``torch.py`` (which documents the formulas), c = -scale / N, N = H W.

The inputs are the projection's six views (q1, k1, v1 (B, heads, N, d) and q2, k2, v2 (B, d, H, W), any strides:
the qkv split is never copied).  Every launch runs both branches, split by program id: the first ``n_sw`` programs
work on the SwiGLU branch (one per (batch, head, token chunk or tile), or per (batch, head, half of [W1 | W2]) in the
finalize steps), the rest on the conv branch (one per (batch, block of BLOCK_CH channels, pixel chunk or tile): 2-D
(pixels x channels) tiles, contiguous along the channels of the (B, N, 3C + 3d) projection, one load per tap).
Activations are loaded in their own dtype; SwiGLU products are ``tl.dot`` on the input dtype (tensor cores for
fp16/bf16; fp32 as ``triton_utils.dot_prec`` says) with fp32 accumulation, every elementwise step and every
reduction in fp32; results are stored in the output's dtype.  Program ids are int64 (``pid64``): every base offset
is 64-bit.  Per-image sizes are not specialised (``jit_sizes``): one compiled variant per dtype and head dim.

Forward:
  1. ``_fwd_update``: fp32 partials of k^T A (SwiGLU, d x 2d per chunk) and of the conv taps t(k, v) (9 per chunk).
  2. ``_fwd_finalize`` (grid: batch x heads x 2 halves + batch x channel blocks): sums the partials, G = c sum
     (saved for backward, fp32), column-normalises, W' = W - G^ (fp32).
  3. ``_fwd_apply``: out = (q W1') silu(q W2') and dwconv(q2, w3') straight into the (B, N, C + d) output.
Backward (dO = the output's cotangent, dqkv the (B, N, 3C + 3d) buffer of the projection's cotangent):
  1. ``_bwd_apply``: dq of both branches into dqkv; partials of dW' = q^T dy (SwiGLU) and taps(q2, dO2) (conv).
  2. ``_bwd_finalize`` (same grid as the forward's): dG = normalize_columns_bwd(G, -dW') per (batch, head, half),
     dG3 and each batch's taps(q2, dO2); zeroes dW1, dW2, dw3.
  3. ``_bwd_update``: dk, dv of both branches into dqkv; dW += dW' + k^T dz per program and dw3 += each batch's
     taps, by relaxed fp32 atomic adds (no fences; the summation order varies).  Under
     ``torch.use_deterministic_algorithms`` the programs store their partials instead and a fourth launch,
     ``_bwd_reduce``, sums them in a fixed order (bitwise reproducible).
  fp16: dG is scaled to max |dG| = 1 before it meets the fp16 tiles, c max|dG| applied in fp32 (c dG itself can be
  subnormal in fp16).
H-ViT3's 2-D RoPE (``ROPE``, given the (H, W, C / 2) cos / sin tables of ``rope.rope_2d_tables``): q1 and k1 are
turned where they are loaded (``_rope``: channel pairs (2p, 2p + 1) as complex numbers, in fp32, then cast to the
input dtype as the aten form does), and dq, dk turned back (angle -theta) before they are stored into dqkv, so the
op takes and returns the projection's unrotated views.
Extra memory: fp32 partials (d x 2d per chunk of TILES * BLOCK_N tokens, 16 x d per batch and pixel chunk), G, W', dG
(d x 2d per (batch, head)) and 32 floats per (batch, channel); nothing of size N x d beyond the outputs themselves.
Every program holds whole d x d tiles: ``backend.MAX_HEAD_DIM["vit3_qkv_fused"]`` (64) is the largest head dim the op
sends here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import load_tile_raw as _ld, store_tile as _st, dot_acc as _dot
from ..triton_utils import block_d as _block_d, dot_prec, jit_sizes, pid64, wstrides as _wstrides

__all__ = ["qkv_fused_fwd", "qkv_fused_bwd", "launch_cfg"]

BLOCK_N = 64      # tokens per SwiGLU tile
TILES = 4         # tiles (SwiGLU) or pixel tiles (conv) reduced per program in the reducing launches
BLOCK_P = 32      # pixels per conv tile (a BLOCK_P x BLOCK_CH tile, contiguous along the channels)
BLOCK_CH = 32     # channels per conv tile (fewer for smaller head dims)

# warps per (kernel, activation dtype, padded head dim) where the default 8 spills on sm_90 (ptxas -v of the launches
# as the models make them, experiments/compile_kernels.py; with and without H-ViT3's RoPE): 4-16 bytes spilled there
WARPS = {("_bwd_apply", torch.float16, 32): 16, ("_bwd_apply", torch.bfloat16, 32): 16,
         ("_bwd_apply", torch.float32, 32): 4, ("_bwd_update", torch.float32, 32): 16}


def launch_cfg(bd: int, dtype: torch.dtype = torch.float32, kernel: str = "", warps=None):
    """(token tile, warps) of ``kernel``'s launch for padded head dim ``bd`` and activations in ``dtype``: the one
    place that picks them (``warps``: the table, this module's ``WARPS`` unless given).  The token tile is the same for
    every kernel of a direction (the backward's partials are laid out by it): 32 tokens up to d = 32, 16 above."""
    return (32 if bd <= 32 else 16), (WARPS if warps is None else warps).get((kernel, dtype, bd), 8)


def conv_block(bd: int) -> int:
    """Channels per conv tile for padded head dim ``bd``."""
    return min(BLOCK_CH, bd)


# ------------------------------------------------------------------------------------------------ helpers


@triton.jit
def _silu_parts(z):
    """(silu(z), silu'(z), sigmoid(z)) in fp32."""
    s = tl.sigmoid(z)
    silu = z * s
    return silu, s + silu * (1.0 - s), s


@triton.jit
def _split(pid, inner, n_inner):
    """(outer, inner index) of ``pid`` over ``n_inner`` inner programs, and (outer // inner, outer % inner)."""
    outer = pid // n_inner
    return outer // inner, outer % inner, outer, pid % n_inner


@triton.jit
def _conv_rows(chunk_tile, offs_p0, Hh, Ww):
    """(row, column, in-map mask) of the pixels ``chunk_tile * BLOCK_P + offs_p0``."""
    offs_p = chunk_tile + offs_p0
    return offs_p // Ww, offs_p % Ww, offs_p < Hh * Ww


@triton.jit
def _shifted(X, xbase, sxc, sxh, sxw, y, x, pm, offs_c, cm, Hh, Ww, TAP: tl.constexpr):
    """x[p + tap, c] on a (pixels x channels) tile, contiguous along the channels; zero outside the map; fp32.  Tap
    4 is the pixel itself."""
    yy, xx = y + (TAP // 3 - 1), x + (TAP % 3 - 1)
    m = (pm & (yy >= 0) & (yy < Hh) & (xx >= 0) & (xx < Ww))[:, None] & cm[None, :]
    return tl.load(X + xbase + (yy * sxh + xx * sxw)[:, None] + offs_c[None, :] * sxc, mask=m,
                   other=0.0).to(tl.float32)


@triton.jit
def _taps_tile(acc, X, E, xbase, ebase, sxc, sxh, sxw, sec, seh, sew, y, x, pm, offs_c, cm, Hh, Ww):
    """acc[tap, c] += sum over this pixel tile of xpad[p + tap, c] e[p, c] (taps 0..8 of a (16, channels) acc)."""
    offs_t = tl.arange(0, 16)
    e = _shifted(E, ebase, sec, seh, sew, y, x, pm, offs_c, cm, Hh, Ww, 4)
    for tap in tl.static_range(9):
        s = tl.sum(_shifted(X, xbase, sxc, sxh, sxw, y, x, pm, offs_c, cm, Hh, Ww, tap) * e, axis=0)
        acc = tl.where(offs_t[:, None] == tap, acc + s[None, :], acc)
    return acc


@triton.jit
def _conv_tile(X, O, xbase, obase, W, wbase, sxc, sxh, sxw, soc, soh, sow, y, x, pm, offs_c, cm, Hh, Ww, alpha,
               FLIP: tl.constexpr):
    """o[p, c] = alpha sum_taps w[c, tap] xpad[p + tap, c] on this tile; w fp32 at W + wbase + c * 16 + tap
    (``FLIP``: tap 8 - tap, the transposed conv)."""
    out = tl.zeros((y.shape[0], offs_c.shape[0]), dtype=tl.float32)
    for tap in tl.static_range(9):
        wt = tl.load(W + wbase + offs_c * 16 + (8 - tap if FLIP else tap), mask=cm, other=0.0)
        out += _shifted(X, xbase, sxc, sxh, sxw, y, x, pm, offs_c, cm, Hh, Ww, tap) * wt[None, :]
    m = pm[:, None] & cm[None, :]
    tl.store(O + obase + (y * soh + x * sow)[:, None] + offs_c[None, :] * soc, (out * alpha).to(O.dtype.element_ty),
             mask=m)


@triton.jit
def _taps_ptr(bc, chunk, n_pchunks, DC, offs_t, offs_c):
    """Offsets of a (16, channels) block of a (B, chunks, 16, d) fp32 taps buffer; ``bc`` = b (batch)."""
    return ((bc * n_pchunks + chunk) * 16 + offs_t[:, None]) * DC + offs_c[None, :]


@triton.jit
def _rope(x, CS, SN, h, offs_n, stn, N, D, SIGN: tl.constexpr, BLOCK_D: tl.constexpr):
    """H-ViT3's 2-D RoPE on head ``h``'s (tokens x head dim) fp32 tile: channel pairs (2p, 2p + 1) turn as complex
    numbers by the angles of the (N, C / 2) cos / sin tables (row stride ``stn``); ``SIGN`` -1: the inverse turn
    (the transpose, for dq and dk)."""
    offs_p = tl.arange(0, BLOCK_D // 2)
    m = (offs_n[:, None] < N) & (offs_p[None, :] < D // 2)
    at = h * (D // 2) + offs_n[:, None] * stn + offs_p[None, :]
    cs = tl.load(CS + at, mask=m, other=1.0).to(tl.float32)
    sn = tl.load(SN + at, mask=m, other=0.0).to(tl.float32) * SIGN
    re, im = tl.split(tl.reshape(x, (x.shape[0], BLOCK_D // 2, 2)))
    return tl.reshape(tl.join(re * cs - im * sn, im * cs + re * sn), (x.shape[0], BLOCK_D))


# ------------------------------------------------------------------------------------------------ forward
@jit_sizes
def _fwd_update(K1, V1, W1, W2, K2, V2, P, PC, CS, SN,
                sk1b, sk1h, sk1n, sk1d, sv1b, sv1h, sv1n, sv1d, swb, swh, swr, swc,
                sk2b, sk2c, sk2h, sk2w, sv2b, sv2c, sv2h, sv2w, stn,
                HEADS, N, D, DC, Hh, Ww, n_chunks, n_pchunks, n_sw, n_cb,
                TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_CH: tl.constexpr, PREC: tl.constexpr, ROPE: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # SwiGLU: partial of k^T [v silu(z2), v z1 silu'(z2)], z = k W, over TILES token tiles
        b, h, bh, chunk = _split(pid, HEADS, n_chunks)
        offs_d = tl.arange(0, BLOCK_D)
        act = K1.dtype.element_ty  # the d x d operands cast once to the activations' dtype (fewer registers)
        w1 = _ld(W1, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D).to(act)
        w2 = _ld(W2, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D).to(act)
        p1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            k = _ld(K1, b * sk1b + h * sk1h, offs_n, offs_d, sk1n, sk1d, N, D)
            if ROPE:
                k = _rope(k.to(tl.float32), CS, SN, h, offs_n, stn, N, D, 1.0, BLOCK_D).to(act)
            v = _ld(V1, b * sv1b + h * sv1h, offs_n, offs_d, sv1n, sv1d, N, D).to(tl.float32)
            z1 = _dot(k, w1, PREC)
            silu, dsilu, _ = _silu_parts(_dot(k, w2, PREC))
            kt = tl.trans(k)
            p1 += _dot(kt, v * silu, PREC)
            p2 += _dot(kt, v * z1 * dsilu, PREC)
        base = (bh * n_chunks + chunk) * D * 2 * D
        _st(P, base, p1, offs_d, offs_d, 2 * D, 1, D, D)
        _st(P, base + D, p2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # conv: partial of the taps t(k2, v2) over TILES pixel tiles of BLOCK_CH channels
        b, cb, bcb, chunk = _split(pid - n_sw, n_cb, n_pchunks)
        offs_c = cb * BLOCK_CH + tl.arange(0, BLOCK_CH)
        cm = offs_c < DC
        acc = tl.zeros((16, BLOCK_CH), dtype=tl.float32)
        for t in range(TILES):
            y, x, pm = _conv_rows((chunk * TILES + t) * BLOCK_P, tl.arange(0, BLOCK_P), Hh, Ww)
            acc = _taps_tile(acc, K2, V2, b * sk2b, b * sv2b, sk2c, sk2h, sk2w, sv2c, sv2h, sv2w, y, x, pm, offs_c,
                             cm, Hh, Ww)
        offs_t = tl.arange(0, 16)
        tl.store(PC + _taps_ptr(b, chunk, n_pchunks, DC, offs_t, offs_c), acc, mask=cm[None, :])


@jit_sizes
def _fwd_finalize(P, PC, W1, W2, W3, G, WN, G3, WN3,
                  swb, swh, swr, swc, sw3c, sw3t,
                  HEADS, D, DC, n_chunks, n_pchunks, n_sw, n_cb, c,
                  NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CH: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # one (batch, head, half of [W1 | W2]): G = c sum(partials), W' = W - G^ (d x d, fp32)
        b, h, bh, half = _split(pid, HEADS, 2)
        offs_d = tl.arange(0, BLOCK_D)
        g = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for chunk in range(n_chunks):
            g += _ld(P, (bh * n_chunks + chunk) * D * 2 * D + half * D, offs_d, offs_d, 2 * D, 1, D, D)
        g = g * c
        base = bh * D * 2 * D + half * D
        _st(G, base, g, offs_d, offs_d, 2 * D, 1, D, D)
        if NORM:  # column norms: over the rows (the input dim)
            g = g / (tl.sqrt(tl.sum(g * g, axis=0))[None, :] + 1.0)
        wbase = b * swb + h * swh
        if half == 0:
            w = _ld(W1, wbase, offs_d, offs_d, swr, swc, D, D).to(tl.float32)
        else:
            w = _ld(W2, wbase, offs_d, offs_d, swr, swc, D, D).to(tl.float32)
        _st(WN, base, w - g, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # one (batch, channel block): the 9 taps of BLOCK_CH channels
        b, cb = (pid - n_sw) // n_cb, (pid - n_sw) % n_cb
        offs_t = tl.arange(0, 16)
        offs_c = cb * BLOCK_CH + tl.arange(0, BLOCK_CH)
        m3 = (offs_t[:, None] < 9) & (offs_c[None, :] < DC)
        t3 = tl.zeros((16, BLOCK_CH), dtype=tl.float32)
        for chunk in range(n_pchunks):
            t3 += tl.load(PC + _taps_ptr(b, chunk, n_pchunks, DC, offs_t, offs_c), mask=m3, other=0.0)
        t3 = t3 * c
        tap_ptr = (b * DC + offs_c[None, :]) * 9 + offs_t[:, None]  # G3 (B, d, 3, 3)
        tl.store(G3 + tap_ptr, t3, mask=m3)
        if NORM:
            t3 = t3 / (tl.sqrt(tl.sum(t3 * t3, axis=0))[None, :] + 1.0)
        w3 = tl.load(W3 + offs_c[None, :] * sw3c + offs_t[:, None] * sw3t, mask=m3, other=0.0).to(tl.float32)
        tl.store(WN3 + (b * DC + offs_c[None, :]) * 16 + offs_t[:, None], w3 - t3, mask=offs_c[None, :] < DC)


@jit_sizes
def _fwd_apply(Q1, WN, O1, Q2, WN3, O2, CS, SN,
               sq1b, sq1h, sq1n, sq1d, so1b, so1h, so1n, so1d,
               sq2b, sq2c, sq2h, sq2w, so2b, so2c, so2h, so2w, stn,
               HEADS, N, D, DC, Hh, Ww, n_tiles, n_ptiles, n_sw, n_cb,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_CH: tl.constexpr,
               PREC: tl.constexpr, ROPE: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # one token tile of one (batch, head): out = (q W1') silu(q W2')
        b, h, bh, tile = _split(pid, HEADS, n_tiles)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        q = _ld(Q1, b * sq1b + h * sq1h, offs_n, offs_d, sq1n, sq1d, N, D)
        if ROPE:
            q = _rope(q.to(tl.float32), CS, SN, h, offs_n, stn, N, D, 1.0, BLOCK_D).to(Q1.dtype.element_ty)
        wn1 = _ld(WN, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D).to(Q1.dtype.element_ty)
        wn2 = _ld(WN, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D).to(Q1.dtype.element_ty)
        y1 = _dot(q, wn1, PREC)
        silu, _, _ = _silu_parts(_dot(q, wn2, PREC))
        _st(O1, b * so1b + h * so1h, y1 * silu, offs_n, offs_d, so1n, so1d, N, D)
    else:  # one pixel tile of one (batch, channel block): dwconv(q2, w3')
        b, cb, bcb, tile = _split(pid - n_sw, n_cb, n_ptiles)
        offs_c = cb * BLOCK_CH + tl.arange(0, BLOCK_CH)
        y, x, pm = _conv_rows(tile * BLOCK_P, tl.arange(0, BLOCK_P), Hh, Ww)
        _conv_tile(Q2, O2, b * sq2b, b * so2b, WN3, b * DC * 16, sq2c, sq2h, sq2w, so2c, so2h, so2w, y, x, pm,
                   offs_c, offs_c < DC, Hh, Ww, 1.0, False)


# ----------------------------------------------------------------------------------------------- backward
@jit_sizes
def _bwd_apply(Q1, DO1, WN, DQ1, Q2, DO2, WN3, DQ2, P, PC, CS, SN,
               sq1b, sq1h, sq1n, sq1d, sd1b, sd1h, sd1n, sd1d, sx1b, sx1h, sx1n, sx1d,
               sq2b, sq2c, sq2h, sq2w, sd2b, sd2c, sd2h, sd2w, sx2b, sx2c, sx2h, sx2w, stn,
               HEADS, N, D, DC, Hh, Ww, n_chunks, n_pchunks, n_sw, n_cb,
               TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
               BLOCK_CH: tl.constexpr, PREC: tl.constexpr, ROPE: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # dy = [dO silu(y2), dO y1 silu'(y2)], y = q W'; dq = dy W'^T; partial of dW' = q^T dy
        b, h, bh, chunk = _split(pid, HEADS, n_chunks)
        offs_d = tl.arange(0, BLOCK_D)
        wn1 = _ld(WN, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D).to(Q1.dtype.element_ty)
        wn2 = _ld(WN, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D).to(Q1.dtype.element_ty)
        p1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            q = _ld(Q1, b * sq1b + h * sq1h, offs_n, offs_d, sq1n, sq1d, N, D)
            if ROPE:
                q = _rope(q.to(tl.float32), CS, SN, h, offs_n, stn, N, D, 1.0, BLOCK_D).to(Q1.dtype.element_ty)
            do = _ld(DO1, b * sd1b + h * sd1h, offs_n, offs_d, sd1n, sd1d, N, D).to(tl.float32)
            y1 = _dot(q, wn1, PREC)
            silu, dsilu, _ = _silu_parts(_dot(q, wn2, PREC))
            dy1 = (do * silu).to(q.dtype)
            dy2 = (do * y1 * dsilu).to(q.dtype)
            dq = _dot(dy1, tl.trans(wn1), PREC) + _dot(dy2, tl.trans(wn2), PREC)
            if ROPE:  # the cotangent of the unrotated q
                dq = _rope(dq, CS, SN, h, offs_n, stn, N, D, -1.0, BLOCK_D)
            _st(DQ1, b * sx1b + h * sx1h, dq, offs_n, offs_d, sx1n, sx1d, N, D)
            qt = tl.trans(q)
            p1 += _dot(qt, dy1, PREC)
            p2 += _dot(qt, dy2, PREC)
        base = (bh * n_chunks + chunk) * D * 2 * D
        _st(P, base, p1, offs_d, offs_d, 2 * D, 1, D, D)
        _st(P, base + D, p2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # dq2 = dwconv(dO2, flip(w3')) and a partial of taps(q2, dO2), over TILES pixel tiles
        b, cb, bcb, chunk = _split(pid - n_sw, n_cb, n_pchunks)
        offs_c = cb * BLOCK_CH + tl.arange(0, BLOCK_CH)
        cm = offs_c < DC
        acc = tl.zeros((16, BLOCK_CH), dtype=tl.float32)
        for t in range(TILES):
            y, x, pm = _conv_rows((chunk * TILES + t) * BLOCK_P, tl.arange(0, BLOCK_P), Hh, Ww)
            _conv_tile(DO2, DQ2, b * sd2b, b * sx2b, WN3, b * DC * 16, sd2c, sd2h, sd2w, sx2c, sx2h, sx2w, y, x, pm,
                       offs_c, cm, Hh, Ww, 1.0, True)
            acc = _taps_tile(acc, Q2, DO2, b * sq2b, b * sd2b, sq2c, sq2h, sq2w, sd2c, sd2h, sd2w, y, x, pm, offs_c,
                             cm, Hh, Ww)
        offs_t = tl.arange(0, 16)
        tl.store(PC + _taps_ptr(b, chunk, n_pchunks, DC, offs_t, offs_c), acc, mask=cm[None, :])


@triton.jit
def _colnorm_bwd(g, dgh):
    """normalize_columns backward (norm over rows): dg^/(n+1) - g <dg^, g> / (n (n+1)^2), 0 where n = 0."""
    n = tl.sqrt(tl.sum(g * g, axis=0))
    dot = tl.sum(dgh * g, axis=0)
    coef = tl.where(n > 0, dot / (tl.maximum(n, 1e-30) * (n + 1.0) * (n + 1.0)), 0.0)
    return dgh / (n + 1.0)[None, :] - g * coef[None, :]


@triton.jit
def _st_half(X1, X2, half, base, val, offs_d, D):
    """Into the contiguous d x d matrix at ``base`` of X1 (half 0) or X2 (half 1)."""
    if half == 0:
        _st(X1, base, val, offs_d, offs_d, D, 1, D, D)
    else:
        _st(X2, base, val, offs_d, offs_d, D, 1, D, D)


@jit_sizes
def _bwd_finalize(P, PC, G, DG, DW1, DW2, G3, DG3, D3P, DW3,
                  HEADS, D, DC, n_chunks, n_pchunks, n_sw, n_wb, n_cb,
                  NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CH: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # one (batch, head, half of [W1 | W2]): dG = normalize_columns_bwd(G, -dW')
        b, h, bh, half = _split(pid, HEADS, 2)
        offs_d = tl.arange(0, BLOCK_D)
        d = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for chunk in range(n_chunks):
            d += _ld(P, (bh * n_chunks + chunk) * D * 2 * D + half * D, offs_d, offs_d, 2 * D, 1, D, D)
        base = bh * D * 2 * D + half * D
        if NORM:
            d = _colnorm_bwd(_ld(G, base, offs_d, offs_d, 2 * D, 1, D, D), -d)
        else:
            d = -d
        _st(DG, base, d, offs_d, offs_d, 2 * D, 1, D, D)
        if b < n_wb:  # zero the weight gradient that _bwd_update adds into
            _st_half(DW1, DW2, half, (b * HEADS + h) * D * D, tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32), offs_d,
                     D)
    else:  # one (batch, channel block): dG3 and this batch's taps(q2, dO2) (summed over the batch by the next launch)
        b, cb = (pid - n_sw) // n_cb, (pid - n_sw) % n_cb
        offs_t = tl.arange(0, 16)
        offs_c = cb * BLOCK_CH + tl.arange(0, BLOCK_CH)
        m3 = (offs_t[:, None] < 9) & (offs_c[None, :] < DC)
        t3 = tl.zeros((16, BLOCK_CH), dtype=tl.float32)
        for chunk in range(n_pchunks):
            t3 += tl.load(PC + _taps_ptr(b, chunk, n_pchunks, DC, offs_t, offs_c), mask=m3, other=0.0)
        per_b = (b * DC + offs_c[None, :]) * 16 + offs_t[:, None]  # (B, d, 16)
        tl.store(D3P + per_b, t3, mask=m3)
        if NORM:
            g3t = tl.load(G3 + (b * DC + offs_c[None, :]) * 9 + offs_t[:, None], mask=m3, other=0.0)
            t3 = _colnorm_bwd(g3t, -t3)
        else:
            t3 = -t3
        tl.store(DG3 + per_b, t3, mask=offs_c[None, :] < DC)
        if b == 0:
            tl.store(DW3 + offs_c[None, :] * 9 + offs_t[:, None], tl.zeros((16, BLOCK_CH), dtype=tl.float32),
                     mask=m3)


@jit_sizes
def _bwd_update(K1, V1, W1, W2, DG, DK1, DV1, P, DW1, DW2, K2, V2, DG3, DK2, DV2, D3P, DW3, CS, SN,
                sk1b, sk1h, sk1n, sk1d, sv1b, sv1h, sv1n, sv1d, swb, swh, swr, swc,
                sxkb, sxkh, sxkn, sxkd, sxvb, sxvh, sxvn, sxvd,
                sk2b, sk2c, sk2h, sk2w, sv2b, sv2c, sv2h, sv2w,
                syk2b, syk2c, syk2h, syk2w, syv2b, syv2c, syv2h, syv2w, stn,
                HEADS, N, D, DC, Hh, Ww, n_chunks, n_ptiles, n_sw, n_wb, n_cb, c,
                TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_CH: tl.constexpr, PREC: tl.constexpr, DETERMINISTIC: tl.constexpr, ROPE: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # recompute z = k W, A; dk, dv; dW = (dW' + k^T dz) over TILES token tiles
        b, h, bh, chunk = _split(pid, HEADS, n_chunks)
        offs_d = tl.arange(0, BLOCK_D)
        act = K1.dtype.element_ty  # the d x d operands cast once to the activations' dtype (fewer registers)
        w1 = _ld(W1, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D).to(act)
        w2 = _ld(W2, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D).to(act)
        # dG scaled to max |dG| = 1 before it meets the fp16/bf16 tiles, c max|dG| applied in fp32 to the products
        # (c dG itself can be subnormal in fp16: c = -scale / N)
        dg1 = _ld(DG, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D)
        dg2 = _ld(DG, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D)
        mx = tl.maximum(tl.max(tl.max(tl.abs(dg1), axis=1), axis=0), tl.max(tl.max(tl.abs(dg2), axis=1), axis=0))
        mx = tl.where(mx > 0, mx, 1.0)
        dg1, dg2 = (dg1 / mx).to(act), (dg2 / mx).to(act)
        f = c * mx
        dw1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        dw2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            k = _ld(K1, b * sk1b + h * sk1h, offs_n, offs_d, sk1n, sk1d, N, D)
            if ROPE:
                k = _rope(k.to(tl.float32), CS, SN, h, offs_n, stn, N, D, 1.0, BLOCK_D).to(act)
            v = _ld(V1, b * sv1b + h * sv1h, offs_n, offs_d, sv1n, sv1d, N, D).to(tl.float32)
            z1 = _dot(k, w1, PREC)
            z2 = _dot(k, w2, PREC)
            silu, dsilu, s = _silu_parts(z2)
            d2silu = s * (1.0 - s) * (2.0 + z2 * (1.0 - 2.0 * s))
            da1 = _dot(k, dg1, PREC)  # / f
            da2 = _dot(k, dg2, PREC)
            vd = v * dsilu
            dz1 = (da2 * vd).to(k.dtype)  # / f
            dz2 = (da1 * vd + da2 * v * z1 * d2silu).to(k.dtype)
            dk = _dot((v * silu).to(k.dtype), tl.trans(dg1), PREC)
            dk += _dot((z1 * vd).to(k.dtype), tl.trans(dg2), PREC)
            dk += _dot(dz1, tl.trans(w1), PREC)
            dk += _dot(dz2, tl.trans(w2), PREC)
            if ROPE:  # the cotangent of the unrotated k
                dk = _rope(dk, CS, SN, h, offs_n, stn, N, D, -1.0, BLOCK_D)
            _st(DK1, b * sxkb + h * sxkh, dk * f, offs_n, offs_d, sxkn, sxkd, N, D)
            _st(DV1, b * sxvb + h * sxvh, (da1 * silu + da2 * z1 * dsilu) * f, offs_n, offs_d, sxvn, sxvd, N, D)
            kt = tl.trans(k)
            dw1 += _dot(kt, dz1, PREC)
            dw2 += _dot(kt, dz2, PREC)
        base = (bh * n_chunks + chunk) * D * 2 * D  # this program's partial of dW' (from _bwd_apply), replaced
        dw1 = dw1 * f + _ld(P, base, offs_d, offs_d, 2 * D, 1, D, D)
        dw2 = dw2 * f + _ld(P, base + D, offs_d, offs_d, 2 * D, 1, D, D)
        if DETERMINISTIC:  # summed in a fixed order by _bwd_reduce
            _st(P, base, dw1, offs_d, offs_d, 2 * D, 1, D, D)
            _st(P, base + D, dw2, offs_d, offs_d, 2 * D, 1, D, D)
        else:  # relaxed fp32 adds: no fences, the order (and the last bits) vary from run to run
            m = (offs_d[:, None] < D) & (offs_d[None, :] < D)
            offs = offs_d[:, None] * D + offs_d[None, :]
            wb = (b % n_wb) * HEADS + h
            tl.atomic_add(DW1 + wb * D * D + offs, dw1, mask=m, sem="relaxed")
            tl.atomic_add(DW2 + wb * D * D + offs, dw2, mask=m, sem="relaxed")
    else:  # one pixel tile: dk2 = c dwconv(v2, flip(dG3)), dv2 = c dwconv(k2, dG3)
        b, cb, bcb, tile = _split(pid - n_sw, n_cb, n_ptiles)
        offs_c = cb * BLOCK_CH + tl.arange(0, BLOCK_CH)
        cm = offs_c < DC
        y, x, pm = _conv_rows(tile * BLOCK_P, tl.arange(0, BLOCK_P), Hh, Ww)
        _conv_tile(V2, DK2, b * sv2b, b * syk2b, DG3, b * DC * 16, sv2c, sv2h, sv2w, syk2c, syk2h, syk2w, y, x, pm,
                   offs_c, cm, Hh, Ww, c, True)
        _conv_tile(K2, DV2, b * sk2b, b * syv2b, DG3, b * DC * 16, sk2c, sk2h, sk2w, syv2c, syv2h, syv2w, y, x, pm,
                   offs_c, cm, Hh, Ww, c, False)
        if not DETERMINISTIC:
            if tile == 0:  # this batch's taps into dw3
                offs_t = tl.arange(0, 16)
                m3 = (offs_t[:, None] < 9) & cm[None, :]
                t3 = tl.load(D3P + (b * DC + offs_c[None, :]) * 16 + offs_t[:, None], mask=m3, other=0.0)
                tl.atomic_add(DW3 + offs_c[None, :] * 9 + offs_t[:, None], t3, mask=m3, sem="relaxed")


@jit_sizes
def _bwd_reduce(P, DW1, DW2, D3P, DW3, B, HEADS, D, DC, n_chunks, n_sw, n_wb,
                BLOCK_D: tl.constexpr, BLOCK_CH: tl.constexpr):
    """Deterministic mode only: dW = the sum of _bwd_update's partials in a fixed order (over the weight's batches
    and chunks), dw3 = the sum over the batch of the taps."""
    pid = pid64(0)
    if pid < n_sw:  # one (weight batch or shared, head, half)
        wb, h, _, half = _split(pid, HEADS, 2)
        offs_d = tl.arange(0, BLOCK_D)
        acc = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        per = B // n_wb
        for i in range(per):
            bh = (wb * per + i) * HEADS + h
            for chunk in range(n_chunks):
                acc += _ld(P, (bh * n_chunks + chunk) * D * 2 * D + half * D, offs_d, offs_d, 2 * D, 1, D, D)
        _st_half(DW1, DW2, half, (wb * HEADS + h) * D * D, acc, offs_d, D)
    else:  # one channel block
        offs_t = tl.arange(0, 16)
        offs_c = (pid - n_sw) * BLOCK_CH + tl.arange(0, BLOCK_CH)
        m3 = (offs_t[:, None] < 9) & (offs_c[None, :] < DC)
        acc3 = tl.zeros((16, BLOCK_CH), dtype=tl.float32)
        for b in range(B):
            acc3 += tl.load(D3P + (b * DC + offs_c[None, :]) * 16 + offs_t[:, None], mask=m3, other=0.0)
        tl.store(DW3 + offs_c[None, :] * 9 + offs_t[:, None], acc3, mask=m3)


# ------------------------------------------------------------------------------------------------ launchers
def _check(q1, k1, v1, q2, k2, v2, w1, w2, w3):
    b, heads, n, d = q1.shape
    if k1.shape != q1.shape or v1.shape != q1.shape:
        raise ValueError(f"q1, k1, v1 must share a (B, heads, N, d) shape, got {tuple(q1.shape)}, "
                         f"{tuple(k1.shape)}, {tuple(v1.shape)}")
    if q2.dim() != 4 or q2.shape[:2] != (b, d) or q2.shape[2] * q2.shape[3] != n or k2.shape != q2.shape \
            or v2.shape != q2.shape:
        raise ValueError(f"q2, k2, v2 must share a (B, d, H, W) shape with H W = N = {n}, got {tuple(q2.shape)}, "
                         f"{tuple(k2.shape)}, {tuple(v2.shape)}")
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dim() != 4 or w.shape[1:] != (heads, d, d) or w.shape[0] not in (1, b) or w.shape != w1.shape:
            raise ValueError(f"{name} must be (1 or B, heads, d, d) = (1 or {b}, {heads}, {d}, {d}), "
                             f"got {tuple(w.shape)}")
    if w3.shape != (d, 1, 3, 3):
        raise ValueError(f"w3 must be (d, 1, 3, 3) = ({d}, 1, 3, 3), got {tuple(w3.shape)}")


def _rope_args(cos, sin, q1):
    """(cos, sin, row stride, ROPE) for the kernels: H-ViT3's (H, W, C / 2) RoPE tables as (N, C / 2) rows, or
    ``q1`` as an unread placeholder without RoPE."""
    if cos is None or sin is None:
        return q1, q1, 0, False
    b, heads, n, d = q1.shape
    if d % 2 or cos.numel() != n * heads * d // 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be (H, W, C / 2) tables with H W = {n}, C / 2 = {heads * d // 2} and an "
                         f"even head dim, got {tuple(cos.shape)}, {tuple(sin.shape)}, d = {d}")
    cos, sin = cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous()
    return cos, sin, cos.stride(0), True


def _sizes(q1, q2):
    b, heads, n, d = q1.shape
    hh, ww = q2.shape[2], q2.shape[3]
    bd = _block_d(d)
    bn, _ = launch_cfg(bd, q1.dtype)
    return b, heads, n, d, hh, ww, bd, bn, lambda kernel: launch_cfg(bd, q1.dtype, kernel)[1]


def qkv_fused_fwd(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale: float, normalize_grad: bool = True, cos=None,
                  sin=None):
    """(out (B, N, heads d + d) in q1's dtype, G (B, heads, d, 2d) fp32, W' (B, heads, d, 2d) fp32,
    G3 (B, d, 3, 3) fp32, W3' (B, d, 16) fp32 (taps 0..8)) in 3 launches.  With H-ViT3's RoPE tables ``cos``,
    ``sin`` (``rope.rope_2d_tables``), q1 and k1 are turned as the kernels load them."""
    _check(q1, k1, v1, q2, k2, v2, w1, w2, w3)
    cs, sn, stn, rope = _rope_args(cos, sin, q1)
    b, heads, n, d, hh, ww, bd, bn, warps = _sizes(q1, q2)
    c, prec, dev, f32 = -scale / n, dot_prec(q1.dtype), q1.device, torch.float32
    bch = conv_block(bd)
    n_cb = triton.cdiv(d, bch)
    chunks, pchunks = triton.cdiv(n, TILES * bn), triton.cdiv(n, TILES * BLOCK_P)
    part = torch.empty(b * heads, chunks, d, 2 * d, device=dev, dtype=f32)
    part3 = torch.empty(b, pchunks, 16, d, device=dev, dtype=f32)
    n_sw = b * heads * chunks
    blocks = dict(BLOCK_D=bd, BLOCK_CH=bch)
    _fwd_update[(n_sw + b * n_cb * pchunks,)](
        k1, v1, w1, w2, k2, v2, part, part3, cs, sn, *k1.stride(), *v1.stride(), *_wstrides(w1), *k2.stride(),
        *v2.stride(), stn, heads, n, d, d, hh, ww, chunks, pchunks, n_sw, n_cb,
        TILES=TILES, BLOCK_N=bn, BLOCK_P=BLOCK_P, PREC=prec, ROPE=rope, num_warps=warps("_fwd_update"), **blocks)
    g = torch.empty(b, heads, d, 2 * d, device=dev, dtype=f32)
    wn = torch.empty_like(g)
    g3 = torch.empty(b, d, 3, 3, device=dev, dtype=f32)
    wn3 = torch.empty(b, d, 16, device=dev, dtype=f32)
    _fwd_finalize[(b * heads * 2 + b * n_cb,)](
        part, part3, w1, w2, w3, g, wn, g3, wn3, *_wstrides(w1), w3.stride(0), w3.stride(3),
        heads, d, d, chunks, pchunks, b * heads * 2, n_cb, c, NORM=bool(normalize_grad),
        num_warps=warps("_fwd_finalize"), **blocks)
    out = torch.empty(b, n, heads * d + d, device=dev, dtype=q1.dtype)
    o1 = out[..., :heads * d].unflatten(-1, (heads, d)).transpose(1, 2)
    o2 = out[..., heads * d:].transpose(1, 2).unflatten(-1, (hh, ww))
    tiles, ptiles = triton.cdiv(n, bn), triton.cdiv(n, BLOCK_P)
    n_sw = b * heads * tiles
    _fwd_apply[(n_sw + b * n_cb * ptiles,)](
        q1, wn, o1, q2, wn3, o2, cs, sn, *q1.stride(), *o1.stride(), *q2.stride(), *o2.stride(), stn,
        heads, n, d, d, hh, ww, tiles, ptiles, n_sw, n_cb, BLOCK_N=bn, BLOCK_P=BLOCK_P, PREC=prec, ROPE=rope,
        num_warps=warps("_fwd_apply"), **blocks)
    return out, g, wn, g3, wn3


def qkv_fused_bwd(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, g, wn, g3, wn3, scale: float,
                  normalize_grad: bool = True, cos=None, sin=None):
    """(dqkv (B, N, 3 heads d + 3 d) in q1's dtype, dw1, dw2 (w1's shape, fp32), dw3 (d, 1, 3, 3) fp32) in 3
    launches (4 under ``torch.use_deterministic_algorithms``: dW summed in a fixed order instead of by relaxed
    atomic adds); ``dout`` (B, N, heads d + d), any strides.  With the forward's RoPE tables, q1 and k1 are turned
    as loaded and the q1 / k1 columns of dqkv turned back (the cotangents of the unrotated views)."""
    b, heads, n, d, hh, ww, bd, bn, warps = _sizes(q1, q2)
    cs, sn, stn, rope = _rope_args(cos, sin, q1)
    cc = heads * d
    c, prec, dev, f32 = -scale / n, dot_prec(q1.dtype), q1.device, torch.float32
    bch = conv_block(bd)
    n_cb = triton.cdiv(d, bch)
    chunks, pchunks, ptiles = triton.cdiv(n, TILES * bn), triton.cdiv(n, TILES * BLOCK_P), triton.cdiv(n, BLOCK_P)
    deterministic = torch.are_deterministic_algorithms_enabled()
    dqkv = torch.empty(b, n, 3 * cc + 3 * d, device=dev, dtype=q1.dtype)
    dx1 = [dqkv[..., i * cc:(i + 1) * cc].unflatten(-1, (heads, d)).transpose(1, 2) for i in range(3)]
    dx2 = [dqkv[..., 3 * cc + i * d:3 * cc + (i + 1) * d].transpose(1, 2).unflatten(-1, (hh, ww)) for i in range(3)]
    do1 = dout[..., :cc].unflatten(-1, (heads, d)).transpose(1, 2)
    do2 = dout[..., cc:].transpose(1, 2).unflatten(-1, (hh, ww))
    part = torch.empty(b * heads, chunks, d, 2 * d, device=dev, dtype=f32)
    part3 = torch.empty(b, pchunks, 16, d, device=dev, dtype=f32)
    n_sw = b * heads * chunks
    blocks = dict(BLOCK_D=bd, BLOCK_CH=bch)
    _bwd_apply[(n_sw + b * n_cb * pchunks,)](
        q1, do1, wn, dx1[0], q2, do2, wn3, dx2[0], part, part3, cs, sn, *q1.stride(), *do1.stride(),
        *dx1[0].stride(), *q2.stride(), *do2.stride(), *dx2[0].stride(), stn, heads, n, d, d, hh, ww, chunks, pchunks,
        n_sw, n_cb, TILES=TILES, BLOCK_N=bn, BLOCK_P=BLOCK_P, PREC=prec, ROPE=rope,
        num_warps=warps("_bwd_apply"), **blocks)
    n_wb = w1.shape[0]
    dg = torch.empty(b, heads, d, 2 * d, device=dev, dtype=f32)
    dw1 = torch.empty(n_wb, heads, d, d, device=dev, dtype=f32)
    dw2 = torch.empty_like(dw1)
    dg3 = torch.empty(b, d, 16, device=dev, dtype=f32)
    d3p = torch.empty(b, d, 16, device=dev, dtype=f32)  # taps(q2, dO2) per batch
    dw3 = torch.empty(d, 1, 3, 3, device=dev, dtype=f32)
    _bwd_finalize[(b * heads * 2 + b * n_cb,)](
        part, part3, g, dg, dw1, dw2, g3, dg3, d3p, dw3, heads, d, d, chunks, pchunks, b * heads * 2, n_wb, n_cb,
        NORM=bool(normalize_grad), num_warps=warps("_bwd_finalize"), **blocks)
    n_sw = b * heads * chunks
    _bwd_update[(n_sw + b * n_cb * ptiles,)](
        k1, v1, w1, w2, dg, dx1[1], dx1[2], part, dw1, dw2, k2, v2, dg3, dx2[1], dx2[2], d3p, dw3, cs, sn,
        *k1.stride(), *v1.stride(), *_wstrides(w1), *dx1[1].stride(), *dx1[2].stride(), *k2.stride(), *v2.stride(),
        *dx2[1].stride(), *dx2[2].stride(), stn, heads, n, d, d, hh, ww, chunks, ptiles, n_sw, n_wb, n_cb, c,
        TILES=TILES, BLOCK_N=bn, BLOCK_P=BLOCK_P, PREC=prec, DETERMINISTIC=deterministic, ROPE=rope,
        num_warps=warps("_bwd_update"), **blocks)
    if deterministic:
        _bwd_reduce[(n_wb * heads * 2 + n_cb,)](part, dw1, dw2, d3p, dw3, b, heads, d, d, chunks, n_wb * heads * 2, n_wb,
                                                num_warps=warps("_bwd_reduce"), **blocks)
    return dqkv, dw1, dw2, dw3
