"""The ViT3 mixer core's inner steps (SwiGLU branch and 3x3 depthwise-conv branch together) in 3 Triton launches
forward and 3 backward.  Same math as ``torch.py`` (which documents the formulas), c = -scale / N, N = H W.

The inputs are the projection's six views (q1, k1, v1 (B, heads, N, d) and q2, k2, v2 (B, d, H, W), any strides:
the qkv split is never copied).  Every launch runs both branches, split by program id: the first ``n_sw`` programs
work on the SwiGLU branch (one per (batch, head, token chunk or tile)), the rest on the conv branch (one per
(batch, channel, pixel chunk or tile)).  Activations are loaded in their own dtype; SwiGLU products are ``tl.dot``
on the input dtype (tensor cores for fp16/bf16; fp32 as ``triton_utils.dot_prec`` says) with fp32 accumulation,
every elementwise step and every reduction in fp32; results are stored in the output's dtype.

Forward:
  1. ``_fwd_update``: fp32 partials of k^T A (SwiGLU, d x 2d per chunk) and of the conv taps t(k, v) (9 per chunk).
  2. ``_fwd_finalize``: sums them, G = c sum (saved for backward, fp32), column-normalises, W' = W - G^ (fp32).
  3. ``_fwd_apply``: out = (q W1') silu(q W2') and dwconv(q2, w3') straight into the (B, N, C + d) output.
Backward (dO = the output's cotangent, dqkv the (B, N, 3C + 3d) buffer of the projection's cotangent):
  1. ``_bwd_apply``: dq of both branches into dqkv; partials of dW' = q^T dy (SwiGLU) and taps(q2, dO2) (conv).
  2. ``_bwd_finalize``: sums them, dG = normalize_columns_bwd(G, -dW'), dW1/dW2 initialised with dW' (summed over
     the batch for shared weights), dw3 = sum over the batch of taps(q2, dO2).
  3. ``_bwd_update``: dk, dv of both branches into dqkv; dW += k^T dz (fp32 atomic adds).
Extra memory: fp32 partials (d x 2d per chunk of TILES * BLOCK_N tokens, 16 per conv chunk), G, W', dG (d x 2d per
(batch, head)) and 16 floats per (batch, channel); nothing of size N x d beyond the outputs themselves.
Every program holds whole d x d tiles: ``backend.MAX_HEAD_DIM["vit3_qkv_fused"]`` (64) is the largest head dim the op sends here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import block_d as _block_d, dot_prec, wstrides as _wstrides

__all__ = ["qkv_fused_fwd", "qkv_fused_bwd", "launch_cfg"]

BLOCK_N = 64      # tokens per SwiGLU tile
TILES = 4         # tiles (SwiGLU) or pixel tiles (conv) reduced per program in the reducing launches
BLOCK_P = 256     # pixels per conv tile


def launch_cfg(bd: int):
    """(token tile, warps) of the SwiGLU programs for padded head dim ``bd``: the one place that picks them, from the
    sm_90 ptxas report (experiments/results/vit3_triton_compile.md: no spills)."""
    return (BLOCK_N, 4) if bd <= 32 else (32, 8)


# ------------------------------------------------------------------------------------------------ helpers
@triton.jit
def _ld(ptr, base, offs_r, offs_c, sr, sc, r_max, c_max):
    """A masked 2-D tile in the tensor's own dtype (zeros outside)."""
    m = (offs_r[:, None] < r_max) & (offs_c[None, :] < c_max)
    return tl.load(ptr + base + offs_r[:, None] * sr + offs_c[None, :] * sc, mask=m, other=0.0)


@triton.jit
def _st(ptr, base, val, offs_r, offs_c, sr, sc, r_max, c_max):
    m = (offs_r[:, None] < r_max) & (offs_c[None, :] < c_max)
    tl.store(ptr + base + offs_r[:, None] * sr + offs_c[None, :] * sc, val.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b on a's dtype (b cast to it), fp32 accumulation."""
    return tl.dot(a, b.to(a.dtype), input_precision=PREC, out_dtype=tl.float32)


@triton.jit
def _silu_parts(z):
    """(silu(z), silu'(z), sigmoid(z)) in fp32."""
    s = tl.sigmoid(z)
    silu = z * s
    return silu, s + silu * (1.0 - s), s


@triton.jit
def _sw_program(pid, HEADS, n_per_bh):
    """(batch, head, b * HEADS + h, chunk or tile) of a SwiGLU program."""
    bh = pid // n_per_bh
    return bh // HEADS, bh % HEADS, bh, pid % n_per_bh


@triton.jit
def _cv_program(pid, DC, n_per_map):
    """(batch, channel, b * DC + channel, chunk or tile) of a conv program (pid counted from the branch's first)."""
    bc = pid // n_per_map
    return bc // DC, bc % DC, bc, pid % n_per_map


@triton.jit
def _taps_window(X, xbase, sxh, sxw, Hh, Ww, offs_p):
    """xs[p, t] = xpad[p + tap t] (taps 0..8 of the 3x3 window, zero padding; lanes 9..15 zero), fp32; and the mask
    of the valid pixels."""
    offs_t = tl.arange(0, 16)
    ti, tj = offs_t // 3 - 1, offs_t % 3 - 1
    y, x = offs_p // Ww, offs_p % Ww
    pm = offs_p < Hh * Ww
    yy = y[:, None] + ti[None, :]
    xx = x[:, None] + tj[None, :]
    m = pm[:, None] & (offs_t[None, :] < 9) & (yy >= 0) & (yy < Hh) & (xx >= 0) & (xx < Ww)
    return tl.load(X + xbase + yy * sxh + xx * sxw, mask=m, other=0.0).to(tl.float32), y, x, pm


@triton.jit
def _taps_tile(X, E, xbase, ebase, sxh, sxw, seh, sew, Hh, Ww, offs_p):
    """sum over this pixel tile of xpad[p + tap] e[p]: 16 fp32 (taps 0..8)."""
    xs, y, x, pm = _taps_window(X, xbase, sxh, sxw, Hh, Ww, offs_p)
    e = tl.load(E + ebase + y * seh + x * sew, mask=pm, other=0.0).to(tl.float32)
    return tl.sum(xs * e[:, None], axis=0)


@triton.jit
def _conv_tile(X, O, xbase, obase, w, sxh, sxw, soh, sow, Hh, Ww, offs_p, alpha):
    """o[p] = alpha sum_taps w[tap] xpad[p + tap] on this pixel tile (w: 16 fp32, zero beyond tap 8)."""
    xs, y, x, pm = _taps_window(X, xbase, sxh, sxw, Hh, Ww, offs_p)
    out = tl.sum(xs * w[None, :], axis=1) * alpha
    tl.store(O + obase + y * soh + x * sow, out.to(O.dtype.element_ty), mask=pm)


# ------------------------------------------------------------------------------------------------ forward
@triton.jit
def _fwd_update(K1, V1, W1, W2, K2, V2, P, PC,
                sk1b, sk1h, sk1n, sk1d, sv1b, sv1h, sv1n, sv1d, swb, swh, swr, swc,
                sk2b, sk2c, sk2h, sk2w, sv2b, sv2c, sv2h, sv2w,
                HEADS, N, D, DC, Hh, Ww, n_chunks, n_pchunks, n_sw,
                TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                PREC: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_sw:  # SwiGLU: partial of k^T [v silu(z2), v z1 silu'(z2)], z = k W, over TILES token tiles
        b, h, bh, chunk = _sw_program(pid, HEADS, n_chunks)
        offs_d = tl.arange(0, BLOCK_D)
        w1 = _ld(W1, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D)
        w2 = _ld(W2, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D)
        p1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            k = _ld(K1, b * sk1b + h * sk1h, offs_n, offs_d, sk1n, sk1d, N, D)
            v = _ld(V1, b * sv1b + h * sv1h, offs_n, offs_d, sv1n, sv1d, N, D).to(tl.float32)
            z1 = _dot(k, w1, PREC)
            silu, dsilu, _ = _silu_parts(_dot(k, w2, PREC))
            kt = tl.trans(k)
            p1 += _dot(kt, v * silu, PREC)
            p2 += _dot(kt, v * z1 * dsilu, PREC)
        base = (bh * n_chunks + chunk) * D * 2 * D
        _st(P, base, p1, offs_d, offs_d, 2 * D, 1, D, D)
        _st(P, base + D, p2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # conv: partial of the taps t(k2, v2) over TILES pixel tiles
        b, ch, bc, chunk = _cv_program(pid - n_sw, DC, n_pchunks)
        acc = tl.zeros((16,), dtype=tl.float32)
        for t in range(TILES):
            offs_p = (chunk * TILES + t) * BLOCK_P + tl.arange(0, BLOCK_P)
            acc += _taps_tile(K2, V2, b * sk2b + ch * sk2c, b * sv2b + ch * sv2c, sk2h, sk2w, sv2h, sv2w, Hh, Ww,
                              offs_p)
        tl.store(PC + (bc * n_pchunks + chunk) * 16 + tl.arange(0, 16), acc)


@triton.jit
def _fwd_finalize(P, PC, W1, W2, W3, G, WN, G3, WN3,
                  swb, swh, swr, swc, sw3c, sw3t,
                  HEADS, D, DC, n_chunks, n_pchunks, n_sw, c,
                  NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_sw:  # one (batch, head): G = c sum(partials), W' = W - G^ (both d x 2d, fp32)
        b, h = pid // HEADS, pid % HEADS
        offs_d = tl.arange(0, BLOCK_D)
        g1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        g2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for chunk in range(n_chunks):
            base = (pid * n_chunks + chunk) * D * 2 * D
            g1 += _ld(P, base, offs_d, offs_d, 2 * D, 1, D, D)
            g2 += _ld(P, base + D, offs_d, offs_d, 2 * D, 1, D, D)
        g1, g2 = g1 * c, g2 * c
        base = pid * D * 2 * D
        _st(G, base, g1, offs_d, offs_d, 2 * D, 1, D, D)
        _st(G, base + D, g2, offs_d, offs_d, 2 * D, 1, D, D)
        if NORM:  # column norms: over the rows (the input dim)
            g1 = g1 / (tl.sqrt(tl.sum(g1 * g1, axis=0))[None, :] + 1.0)
            g2 = g2 / (tl.sqrt(tl.sum(g2 * g2, axis=0))[None, :] + 1.0)
        w1 = _ld(W1, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D).to(tl.float32)
        w2 = _ld(W2, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D).to(tl.float32)
        _st(WN, base, w1 - g1, offs_d, offs_d, 2 * D, 1, D, D)
        _st(WN, base + D, w2 - g2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # one (batch, channel): the 9 taps
        bc = pid - n_sw
        ch = bc % DC
        offs_t = tl.arange(0, 16)
        g = tl.zeros((16,), dtype=tl.float32)
        for chunk in range(n_pchunks):
            g += tl.load(PC + (bc * n_pchunks + chunk) * 16 + offs_t)
        g = g * c
        tl.store(G3 + bc * 9 + offs_t, g, mask=offs_t < 9)
        if NORM:
            g = g / (tl.sqrt(tl.sum(g * g, axis=0)) + 1.0)
        w3 = tl.load(W3 + ch * sw3c + offs_t * sw3t, mask=offs_t < 9, other=0.0).to(tl.float32)
        tl.store(WN3 + bc * 16 + offs_t, w3 - g)


@triton.jit
def _fwd_apply(Q1, WN, O1, Q2, WN3, O2,
               sq1b, sq1h, sq1n, sq1d, so1b, so1h, so1n, so1d,
               sq2b, sq2c, sq2h, sq2w, so2b, so2c, so2h, so2w,
               HEADS, N, D, DC, Hh, Ww, n_tiles, n_ptiles, n_sw,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_sw:  # one token tile of one (batch, head): out = (q W1') silu(q W2')
        b, h, bh, tile = _sw_program(pid, HEADS, n_tiles)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        q = _ld(Q1, b * sq1b + h * sq1h, offs_n, offs_d, sq1n, sq1d, N, D)
        wn1 = _ld(WN, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D)
        wn2 = _ld(WN, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D)
        y1 = _dot(q, wn1, PREC)
        silu, _, _ = _silu_parts(_dot(q, wn2, PREC))
        _st(O1, b * so1b + h * so1h, y1 * silu, offs_n, offs_d, so1n, so1d, N, D)
    else:  # one pixel tile of one (batch, channel): dwconv(q2, w3')
        b, ch, bc, tile = _cv_program(pid - n_sw, DC, n_ptiles)
        w = tl.load(WN3 + bc * 16 + tl.arange(0, 16))
        offs_p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        _conv_tile(Q2, O2, b * sq2b + ch * sq2c, b * so2b + ch * so2c, w, sq2h, sq2w, so2h, so2w, Hh, Ww, offs_p,
                   1.0)


# ----------------------------------------------------------------------------------------------- backward
@triton.jit
def _bwd_apply(Q1, DO1, WN, DQ1, Q2, DO2, WN3, DQ2, P, PC,
               sq1b, sq1h, sq1n, sq1d, sd1b, sd1h, sd1n, sd1d, sx1b, sx1h, sx1n, sx1d,
               sq2b, sq2c, sq2h, sq2w, sd2b, sd2c, sd2h, sd2w, sx2b, sx2c, sx2h, sx2w,
               HEADS, N, D, DC, Hh, Ww, n_chunks, n_pchunks, n_sw,
               TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
               PREC: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_sw:  # dy = [dO silu(y2), dO y1 silu'(y2)], y = q W'; dq = dy W'^T; partial of dW' = q^T dy
        b, h, bh, chunk = _sw_program(pid, HEADS, n_chunks)
        offs_d = tl.arange(0, BLOCK_D)
        wn1 = _ld(WN, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D)
        wn2 = _ld(WN, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D)
        p1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            q = _ld(Q1, b * sq1b + h * sq1h, offs_n, offs_d, sq1n, sq1d, N, D)
            do = _ld(DO1, b * sd1b + h * sd1h, offs_n, offs_d, sd1n, sd1d, N, D).to(tl.float32)
            y1 = _dot(q, wn1, PREC)
            silu, dsilu, _ = _silu_parts(_dot(q, wn2, PREC))
            dy1 = (do * silu).to(q.dtype)
            dy2 = (do * y1 * dsilu).to(q.dtype)
            dq = _dot(dy1, tl.trans(wn1), PREC) + _dot(dy2, tl.trans(wn2), PREC)
            _st(DQ1, b * sx1b + h * sx1h, dq, offs_n, offs_d, sx1n, sx1d, N, D)
            qt = tl.trans(q)
            p1 += _dot(qt, dy1, PREC)
            p2 += _dot(qt, dy2, PREC)
        base = (bh * n_chunks + chunk) * D * 2 * D
        _st(P, base, p1, offs_d, offs_d, 2 * D, 1, D, D)
        _st(P, base + D, p2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # dq2 = dwconv(dO2, flip(w3')) and a partial of taps(q2, dO2), over TILES pixel tiles
        b, ch, bc, chunk = _cv_program(pid - n_sw, DC, n_pchunks)
        offs_t = tl.arange(0, 16)
        wf = tl.load(WN3 + bc * 16 + 8 - offs_t, mask=offs_t < 9, other=0.0)
        acc = tl.zeros((16,), dtype=tl.float32)
        for t in range(TILES):
            offs_p = (chunk * TILES + t) * BLOCK_P + tl.arange(0, BLOCK_P)
            _conv_tile(DO2, DQ2, b * sd2b + ch * sd2c, b * sx2b + ch * sx2c, wf, sd2h, sd2w, sx2h, sx2w, Hh, Ww,
                       offs_p, 1.0)
            acc += _taps_tile(Q2, DO2, b * sq2b + ch * sq2c, b * sd2b + ch * sd2c, sq2h, sq2w, sd2h, sd2w, Hh, Ww,
                              offs_p)
        tl.store(PC + (bc * n_pchunks + chunk) * 16 + offs_t, acc)


@triton.jit
def _colnorm_bwd(g, dgh):
    """normalize_columns backward (norm over rows): dg^/(n+1) - g <dg^, g> / (n (n+1)^2), 0 where n = 0."""
    n = tl.sqrt(tl.sum(g * g, axis=0))
    dot = tl.sum(dgh * g, axis=0)
    coef = tl.where(n > 0, dot / (tl.maximum(n, 1e-30) * (n + 1.0) * (n + 1.0)), 0.0)
    return dgh / (n + 1.0)[None, :] - g * coef[None, :]


@triton.jit
def _bwd_finalize(P, PC, G, DG, DW1, DW2, G3, DG3, DW3,
                  B, HEADS, D, DC, n_chunks, n_pchunks, n_sw, n_wb,
                  NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_sw:  # one weight (batch or shared, head): dG per batch; dW initialised with sum over its batches of dW'
        wb, h = pid // HEADS, pid % HEADS
        offs_d = tl.arange(0, BLOCK_D)
        dw1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        dw2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        per = B // n_wb
        for i in range(per):
            bh = (wb * per + i) * HEADS + h
            d1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
            d2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
            for chunk in range(n_chunks):
                base = (bh * n_chunks + chunk) * D * 2 * D
                d1 += _ld(P, base, offs_d, offs_d, 2 * D, 1, D, D)
                d2 += _ld(P, base + D, offs_d, offs_d, 2 * D, 1, D, D)
            dw1 += d1
            dw2 += d2
            base = bh * D * 2 * D
            if NORM:
                g1 = _ld(G, base, offs_d, offs_d, 2 * D, 1, D, D)
                g2 = _ld(G, base + D, offs_d, offs_d, 2 * D, 1, D, D)
                d1, d2 = _colnorm_bwd(g1, -d1), _colnorm_bwd(g2, -d2)
            else:
                d1, d2 = -d1, -d2
            _st(DG, base, d1, offs_d, offs_d, 2 * D, 1, D, D)
            _st(DG, base + D, d2, offs_d, offs_d, 2 * D, 1, D, D)
        _st(DW1, pid * D * D, dw1, offs_d, offs_d, D, 1, D, D)
        _st(DW2, pid * D * D, dw2, offs_d, offs_d, D, 1, D, D)
    else:  # one channel: dG3 per batch, dw3 = sum over the batch of taps(q2, dO2)
        ch = pid - n_sw
        offs_t = tl.arange(0, 16)
        dw3 = tl.zeros((16,), dtype=tl.float32)
        for b in range(B):
            bc = b * DC + ch
            d = tl.zeros((16,), dtype=tl.float32)
            for chunk in range(n_pchunks):
                d += tl.load(PC + (bc * n_pchunks + chunk) * 16 + offs_t)
            dw3 += d
            if NORM:
                g = tl.load(G3 + bc * 9 + offs_t, mask=offs_t < 9, other=0.0)
                n = tl.sqrt(tl.sum(g * g, axis=0))
                dot = tl.sum(-d * g, axis=0)
                coef = tl.where(n > 0, dot / (tl.maximum(n, 1e-30) * (n + 1.0) * (n + 1.0)), 0.0)
                d = -d / (n + 1.0) - g * coef
            else:
                d = -d
            tl.store(DG3 + bc * 16 + offs_t, d)
        tl.store(DW3 + ch * 9 + offs_t, dw3, mask=offs_t < 9)


@triton.jit
def _bwd_update(K1, V1, W1, W2, DG, DK1, DV1, DW1, DW2, K2, V2, DG3, DK2, DV2,
                sk1b, sk1h, sk1n, sk1d, sv1b, sv1h, sv1n, sv1d, swb, swh, swr, swc,
                sxkb, sxkh, sxkn, sxkd, sxvb, sxvh, sxvn, sxvd,
                sk2b, sk2c, sk2h, sk2w, sv2b, sv2c, sv2h, sv2w,
                syk2b, syk2c, syk2h, syk2w, syv2b, syv2c, syv2h, syv2w,
                HEADS, N, D, DC, Hh, Ww, n_chunks, n_ptiles, n_sw, n_wb, c,
                TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                PREC: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_sw:  # recompute z = k W, A; dk, dv; dW += k^T dz over TILES token tiles
        b, h, bh, chunk = _sw_program(pid, HEADS, n_chunks)
        offs_d = tl.arange(0, BLOCK_D)
        w1 = _ld(W1, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D)
        w2 = _ld(W2, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D)
        dg1 = _ld(DG, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D) * c
        dg2 = _ld(DG, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D) * c
        dw1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        dw2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            k = _ld(K1, b * sk1b + h * sk1h, offs_n, offs_d, sk1n, sk1d, N, D)
            v = _ld(V1, b * sv1b + h * sv1h, offs_n, offs_d, sv1n, sv1d, N, D).to(tl.float32)
            z1 = _dot(k, w1, PREC)
            z2 = _dot(k, w2, PREC)
            silu, dsilu, s = _silu_parts(z2)
            d2silu = s * (1.0 - s) * (2.0 + z2 * (1.0 - 2.0 * s))
            da1 = _dot(k, dg1, PREC)
            da2 = _dot(k, dg2, PREC)
            vd = v * dsilu
            dz1 = (da2 * vd).to(k.dtype)
            dz2 = (da1 * vd + da2 * v * z1 * d2silu).to(k.dtype)
            dk = _dot((v * silu).to(k.dtype), tl.trans(dg1), PREC)
            dk += _dot((z1 * vd).to(k.dtype), tl.trans(dg2), PREC)
            dk += _dot(dz1, tl.trans(w1), PREC)
            dk += _dot(dz2, tl.trans(w2), PREC)
            _st(DK1, b * sxkb + h * sxkh, dk, offs_n, offs_d, sxkn, sxkd, N, D)
            _st(DV1, b * sxvb + h * sxvh, da1 * silu + da2 * z1 * dsilu, offs_n, offs_d, sxvn, sxvd, N, D)
            kt = tl.trans(k)
            dw1 += _dot(kt, dz1, PREC)
            dw2 += _dot(kt, dz2, PREC)
        wbase = ((b % n_wb) * HEADS + h) * D * D
        m = (offs_d[:, None] < D) & (offs_d[None, :] < D)
        offs = offs_d[:, None] * D + offs_d[None, :]
        tl.atomic_add(DW1 + wbase + offs, dw1, mask=m)
        tl.atomic_add(DW2 + wbase + offs, dw2, mask=m)
    else:  # one pixel tile: dk2 = c dwconv(v2, flip(dG3)), dv2 = c dwconv(k2, dG3)
        b, ch, bc, tile = _cv_program(pid - n_sw, DC, n_ptiles)
        offs_t = tl.arange(0, 16)
        dg = tl.load(DG3 + bc * 16 + offs_t, mask=offs_t < 9, other=0.0)
        dgf = tl.load(DG3 + bc * 16 + 8 - offs_t, mask=offs_t < 9, other=0.0)
        offs_p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        _conv_tile(V2, DK2, b * sv2b + ch * sv2c, b * syk2b + ch * syk2c, dgf, sv2h, sv2w, syk2h, syk2w, Hh, Ww,
                   offs_p, c)
        _conv_tile(K2, DV2, b * sk2b + ch * sk2c, b * syv2b + ch * syv2c, dg, sk2h, sk2w, syv2h, syv2w, Hh, Ww,
                   offs_p, c)


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


def _sizes(q1, q2):
    b, heads, n, d = q1.shape
    hh, ww = q2.shape[2], q2.shape[3]
    bd = _block_d(d)
    bn, warps = launch_cfg(bd)
    return b, heads, n, d, hh, ww, bd, bn, warps


def qkv_fused_fwd(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale: float, normalize_grad: bool = True):
    """(out (B, N, heads d + d) in q1's dtype, G (B, heads, d, 2d) fp32, W' (B, heads, d, 2d) fp32,
    G3 (B, d, 3, 3) fp32, W3' (B, d, 16) fp32 (taps 0..8)) in 3 launches."""
    _check(q1, k1, v1, q2, k2, v2, w1, w2, w3)
    b, heads, n, d, hh, ww, bd, bn, warps = _sizes(q1, q2)
    c, prec, dev, f32 = -scale / n, dot_prec(q1.dtype), q1.device, torch.float32
    chunks, pchunks = triton.cdiv(n, TILES * bn), triton.cdiv(n, TILES * BLOCK_P)
    part = torch.empty(b * heads, chunks, d, 2 * d, device=dev, dtype=f32)
    part3 = torch.empty(b * d, pchunks, 16, device=dev, dtype=f32)
    n_sw = b * heads * chunks
    _fwd_update[(n_sw + b * d * pchunks,)](
        k1, v1, w1, w2, k2, v2, part, part3, *k1.stride(), *v1.stride(), *_wstrides(w1), *k2.stride(),
        *v2.stride(), heads, n, d, d, hh, ww, chunks, pchunks, n_sw,
        TILES=TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=BLOCK_P, PREC=prec, num_warps=warps)
    g = torch.empty(b, heads, d, 2 * d, device=dev, dtype=f32)
    wn = torch.empty_like(g)
    g3 = torch.empty(b, d, 3, 3, device=dev, dtype=f32)
    wn3 = torch.empty(b, d, 16, device=dev, dtype=f32)
    _fwd_finalize[(b * heads + b * d,)](
        part, part3, w1, w2, w3, g, wn, g3, wn3, *_wstrides(w1), w3.stride(0), w3.stride(3),
        heads, d, d, chunks, pchunks, b * heads, c, NORM=bool(normalize_grad), BLOCK_D=bd, num_warps=warps)
    out = torch.empty(b, n, heads * d + d, device=dev, dtype=q1.dtype)
    o1 = out[..., :heads * d].unflatten(-1, (heads, d)).transpose(1, 2)
    o2 = out[..., heads * d:].transpose(1, 2).unflatten(-1, (hh, ww))
    tiles, ptiles = triton.cdiv(n, bn), triton.cdiv(n, BLOCK_P)
    n_sw = b * heads * tiles
    _fwd_apply[(n_sw + b * d * ptiles,)](
        q1, wn, o1, q2, wn3, o2, *q1.stride(), *o1.stride(), *q2.stride(), *o2.stride(),
        heads, n, d, d, hh, ww, tiles, ptiles, n_sw, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=BLOCK_P, PREC=prec,
        num_warps=warps)
    return out, g, wn, g3, wn3


def qkv_fused_bwd(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, g, wn, g3, wn3, scale: float,
                  normalize_grad: bool = True):
    """(dqkv (B, N, 3 heads d + 3 d) in q1's dtype, dw1, dw2 (w1's shape, fp32), dw3 (d, 1, 3, 3) fp32) in 3
    launches; ``dout`` (B, N, heads d + d), any strides."""
    b, heads, n, d, hh, ww, bd, bn, warps = _sizes(q1, q2)
    cc = heads * d
    c, prec, dev, f32 = -scale / n, dot_prec(q1.dtype), q1.device, torch.float32
    chunks, pchunks, ptiles = triton.cdiv(n, TILES * bn), triton.cdiv(n, TILES * BLOCK_P), triton.cdiv(n, BLOCK_P)
    dqkv = torch.empty(b, n, 3 * cc + 3 * d, device=dev, dtype=q1.dtype)
    dx1 = [dqkv[..., i * cc:(i + 1) * cc].unflatten(-1, (heads, d)).transpose(1, 2) for i in range(3)]
    dx2 = [dqkv[..., 3 * cc + i * d:3 * cc + (i + 1) * d].transpose(1, 2).unflatten(-1, (hh, ww)) for i in range(3)]
    do1 = dout[..., :cc].unflatten(-1, (heads, d)).transpose(1, 2)
    do2 = dout[..., cc:].transpose(1, 2).unflatten(-1, (hh, ww))
    part = torch.empty(b * heads, chunks, d, 2 * d, device=dev, dtype=f32)
    part3 = torch.empty(b * d, pchunks, 16, device=dev, dtype=f32)
    n_sw = b * heads * chunks
    _bwd_apply[(n_sw + b * d * pchunks,)](
        q1, do1, wn, dx1[0], q2, do2, wn3, dx2[0], part, part3, *q1.stride(), *do1.stride(), *dx1[0].stride(),
        *q2.stride(), *do2.stride(), *dx2[0].stride(), heads, n, d, d, hh, ww, chunks, pchunks, n_sw,
        TILES=TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=BLOCK_P, PREC=prec, num_warps=warps)
    n_wb = w1.shape[0]
    dg = torch.empty(b, heads, d, 2 * d, device=dev, dtype=f32)
    dw1 = torch.empty(n_wb, heads, d, d, device=dev, dtype=f32)
    dw2 = torch.empty_like(dw1)
    dg3 = torch.empty(b, d, 16, device=dev, dtype=f32)
    dw3 = torch.empty(d, 1, 3, 3, device=dev, dtype=f32)
    _bwd_finalize[(n_wb * heads + d,)](
        part, part3, g, dg, dw1, dw2, g3, dg3, dw3, b, heads, d, d, chunks, pchunks, n_wb * heads, n_wb,
        NORM=bool(normalize_grad), BLOCK_D=bd, num_warps=warps)
    n_sw = b * heads * chunks
    _bwd_update[(n_sw + b * d * ptiles,)](
        k1, v1, w1, w2, dg, dx1[1], dx1[2], dw1, dw2, k2, v2, dg3, dx2[1], dx2[2],
        *k1.stride(), *v1.stride(), *_wstrides(w1), *dx1[1].stride(), *dx1[2].stride(), *k2.stride(), *v2.stride(),
        *dx2[1].stride(), *dx2[2].stride(), heads, n, d, d, hh, ww, chunks, ptiles, n_sw, n_wb, c,
        TILES=TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=BLOCK_P, PREC=prec, num_warps=warps)
    return dqkv, dw1, dw2, dw3
