"""The ViT3 inner-loop variants' mixer core (SwiGLU-family branch and 3x3 depthwise-conv branch together) in 3 Triton
launches forward and 3 backward, the layout of ``vit3_ttt/fused.py`` with constexpr switches for the variants.

``KIND`` (constexpr) picks the SwiGLU-branch inner model, c = -scale / N, A = the update's right factor:
  ALL    (the baseline, lr = +-1)  f = (x W1) silu(x W2), both step: A = [v silu(z2), v z1 silu'(z2)], z = k W
  LAST   (Variant 1)               the same f, only W1 steps:          A = [v silu(z2)], W2' = W2
  LINEAR (Variants 3 / 6)          f = x W1:                           A = [v]
G = c k^T A, W' = W - lr N(G) (``NORM``: N = per-column normalisation, else identity), out = f(q; W').  The conv
branch steps as ViT3's with the same ``lr``.  ``lr`` (a runtime float) is sign x steps (ascent, k steps of a loss
linear in the stepped weights).  ``SHARE`` (share_qk, q is k): the projection cotangent has no query rows, so the
backward's dk is added to the dq it wrote into the key rows in its first launch.

Forward: ``_fwd_update`` (fp32 partials of k^T A and of the conv taps, TILES tiles per program), ``_fwd_finalize``
(one program per (batch, head) / (batch, channel): G, W'), ``_fwd_apply`` (out straight into (B, N, C + d)).
Backward: ``_bwd_apply`` (dq into the projection cotangent; partials of dW' = q^T dy and of the conv taps; zeroes
dW), ``_bwd_finalize`` (one program per (batch, head) / (batch, channel): dG; dW += dW' by relaxed atomics),
``_bwd_update`` (dk, dv; dW += k^T dz by relaxed atomics).  Every offset is int64 (program ids through
``triton_utils.pid64``); per-image sizes are not specialised (``triton_utils.jit_sizes``); fp32 accumulation; dG is
scaled to unit max before the cast to the input dtype (the scale applied after the product), so fp16 products do not
go subnormal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import load_tile_raw as _ld, store_tile as _st, atomic_add_mat as _add, dot_acc as _dot
from ..triton_utils import block_d, dot_prec, jit_sizes, pid64, wstrides
from ..vit3_ttt.fused import launch_cfg, _rope, _rope_args

__all__ = ["KINDS", "variant_fused_fwd", "variant_fused_bwd"]

KINDS = {"all": 0, "last": 1, "linear": 2}  # the SwiGLU-branch inner models (torch.branch_kind's names)
ALL: tl.constexpr = tl.constexpr(0)
LAST: tl.constexpr = tl.constexpr(1)
LINEAR: tl.constexpr = tl.constexpr(2)
TILES = 4         # tiles reduced per program in the reducing launches
BLOCK_P = 256     # pixels per conv tile


# ------------------------------------------------------------------------------------------------ helpers


@triton.jit
def _unit(m):
    """(m / max|m|, max|m|): a fp32 matrix scaled to unit max before a cast to fp16 (1 where m is zero)."""
    amax = tl.max(tl.max(tl.abs(m), axis=1), axis=0)
    amax = tl.where(amax > 0, amax, 1.0)
    return m / amax, amax


@triton.jit
def _silu_parts(z):
    """(silu(z), silu'(z), sigmoid(z)) in fp32."""
    s = tl.sigmoid(z)
    silu = z * s
    return silu, s + silu * (1.0 - s), s


@triton.jit
def _colnorm(g):
    return g / (tl.sqrt(tl.sum(g * g, axis=0))[None, :] + 1.0)


@triton.jit
def _colnorm_bwd(g, dgh):
    """normalize_columns backward (norm over rows): dg^/(n+1) - g <dg^, g> / (n (n+1)^2), 0 where n = 0."""
    n = tl.sqrt(tl.sum(g * g, axis=0))
    dot = tl.sum(dgh * g, axis=0)
    coef = tl.where(n > 0, dot / (tl.maximum(n, 1e-30) * (n + 1.0) * (n + 1.0)), 0.0)
    return dgh / (n + 1.0)[None, :] - g * coef[None, :]


@triton.jit
def _taps_window(X, xbase, sxh, sxw, Hh, Ww, offs_p):
    """xs[p, t] = xpad[p + tap t] (taps 0..8 of the 3x3 window, zero padding; lanes 9..15 zero), fp32; and the
    pixel rows, columns and mask."""
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
def _conv_tile(X, O, xbase, obase, w, sxh, sxw, soh, sow, Hh, Ww, offs_p, alpha, ADD: tl.constexpr):
    """o[p] (+)= alpha sum_taps w[tap] xpad[p + tap] on this pixel tile (w: 16 fp32, zero beyond tap 8)."""
    xs, y, x, pm = _taps_window(X, xbase, sxh, sxw, Hh, Ww, offs_p)
    out = tl.sum(xs * w[None, :], axis=1) * alpha
    if ADD:
        out += tl.load(O + obase + y * soh + x * sow, mask=pm, other=0.0).to(tl.float32)
    tl.store(O + obase + y * soh + x * sow, out.to(O.dtype.element_ty), mask=pm)


# ------------------------------------------------------------------------------------------------ forward
@jit_sizes
def _fwd_update(K1, V1, W1, W2, K2, V2, P, PC, CS, SN,
                sk1b, sk1h, sk1n, sk1d, sv1b, sv1h, sv1n, sv1d, swb, swh, swr, swc,
                sk2b, sk2c, sk2h, sk2w, sv2b, sv2c, sv2h, sv2w, stn,
                HEADS, N, D, DC, Hh, Ww, n_chunks, n_pchunks, n_sw,
                KIND: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_P: tl.constexpr, PREC: tl.constexpr, ROPE: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # SwiGLU branch: partial of k^T A over TILES token tiles
        bh, chunk = pid // n_chunks, pid % n_chunks
        b, h = bh // HEADS, bh % HEADS
        offs_d = tl.arange(0, BLOCK_D)
        p1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            k = _ld(K1, b * sk1b + h * sk1h, offs_n, offs_d, sk1n, sk1d, N, D)
            if ROPE:
                k = _rope(k.to(tl.float32), CS, SN, h, offs_n, stn, N, D, 1.0, BLOCK_D).to(K1.dtype.element_ty)
            v = _ld(V1, b * sv1b + h * sv1h, offs_n, offs_d, sv1n, sv1d, N, D).to(tl.float32)
            kt = tl.trans(k)
            if KIND == LINEAR:
                p1 += _dot(kt, v, PREC)
            else:
                w2 = _ld(W2, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D)
                silu, dsilu, _ = _silu_parts(_dot(k, w2, PREC))
                p1 += _dot(kt, v * silu, PREC)
                if KIND == ALL:
                    w1 = _ld(W1, b * swb + h * swh, offs_d, offs_d, swr, swc, D, D)
                    p2 += _dot(kt, v * _dot(k, w1, PREC) * dsilu, PREC)
        base = (bh * n_chunks + chunk) * D * 2 * D
        _st(P, base, p1, offs_d, offs_d, 2 * D, 1, D, D)
        if KIND == ALL:
            _st(P, base + D, p2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # conv branch: partial of the taps t(k2, v2) over TILES pixel tiles
        bc = pid - n_sw
        b, ch, chunk = bc // n_pchunks // DC, bc // n_pchunks % DC, bc % n_pchunks
        acc = tl.zeros((16,), dtype=tl.float32)
        for t in range(TILES):
            offs_p = (chunk * TILES + t) * BLOCK_P + tl.arange(0, BLOCK_P)
            acc += _taps_tile(K2, V2, b * sk2b + ch * sk2c, b * sv2b + ch * sv2c, sk2h, sk2w, sv2h, sv2w, Hh, Ww,
                              offs_p)
        tl.store(PC + bc * 16 + tl.arange(0, 16), acc)


@jit_sizes
def _fwd_finalize(P, PC, W1, W2, W3, G, WN, G3, WN3,
                  swb, swh, swr, swc, sw3c, sw3t,
                  HEADS, D, DC, n_chunks, n_pchunks, n_sw, c, lr,
                  KIND: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # one (batch, head): G = c sum(partials), W' = W - lr N(G) (fp32, d x 2d: [W1' | W2'])
        b, h = pid // HEADS, pid % HEADS
        offs_d = tl.arange(0, BLOCK_D)
        g1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        g2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for chunk in range(n_chunks):
            base = (pid * n_chunks + chunk) * D * 2 * D
            g1 += _ld(P, base, offs_d, offs_d, 2 * D, 1, D, D)
            if KIND == ALL:
                g2 += _ld(P, base + D, offs_d, offs_d, 2 * D, 1, D, D)
        base = pid * D * 2 * D
        wbase = b * swb + h * swh
        g1 = g1 * c
        _st(G, base, g1, offs_d, offs_d, 2 * D, 1, D, D)
        if NORM:
            g1 = _colnorm(g1)
        w1 = _ld(W1, wbase, offs_d, offs_d, swr, swc, D, D).to(tl.float32)
        _st(WN, base, w1 - lr * g1, offs_d, offs_d, 2 * D, 1, D, D)
        if KIND != LINEAR:
            w2 = _ld(W2, wbase, offs_d, offs_d, swr, swc, D, D).to(tl.float32)
            if KIND == ALL:
                g2 = g2 * c
                _st(G, base + D, g2, offs_d, offs_d, 2 * D, 1, D, D)
                if NORM:
                    g2 = _colnorm(g2)
                w2 = w2 - lr * g2
            _st(WN, base + D, w2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # one (batch, channel): the 9 taps
        bc = pid - n_sw
        ch = bc % DC
        offs_t = tl.arange(0, 16)
        g = tl.zeros((16,), dtype=tl.float32)
        for chunk in range(n_pchunks):
            g += tl.load(PC + (bc * n_pchunks + chunk) * 16 + offs_t)
        g = g * c
        tl.store(G3 + bc * 16 + offs_t, g)
        if NORM:
            g = g / (tl.sqrt(tl.sum(g * g, axis=0)) + 1.0)
        w3 = tl.load(W3 + ch * sw3c + offs_t * sw3t, mask=offs_t < 9, other=0.0).to(tl.float32)
        tl.store(WN3 + bc * 16 + offs_t, w3 - lr * g)


@jit_sizes
def _fwd_apply(Q1, WN, O1, Q2, WN3, O2, CS, SN,
               sq1b, sq1h, sq1n, sq1d, so1b, so1h, so1n, so1d,
               sq2b, sq2c, sq2h, sq2w, so2b, so2c, so2h, so2w, stn,
               HEADS, N, D, DC, Hh, Ww, n_tiles, n_ptiles, n_sw,
               KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
               PREC: tl.constexpr, ROPE: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # one token tile of one (batch, head): out = f(q; W')
        bh, tile = pid // n_tiles, pid % n_tiles
        b, h = bh // HEADS, bh % HEADS
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        q = _ld(Q1, b * sq1b + h * sq1h, offs_n, offs_d, sq1n, sq1d, N, D)
        if ROPE:
            q = _rope(q.to(tl.float32), CS, SN, h, offs_n, stn, N, D, 1.0, BLOCK_D).to(Q1.dtype.element_ty)
        out = _dot(q, _ld(WN, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D), PREC)
        if KIND != LINEAR:
            silu, _, _ = _silu_parts(_dot(q, _ld(WN, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D), PREC))
            out = out * silu
        _st(O1, b * so1b + h * so1h, out, offs_n, offs_d, so1n, so1d, N, D)
    else:  # one pixel tile of one (batch, channel): dwconv(q2, w3')
        bc = pid - n_sw
        tile = bc % n_ptiles
        bc = bc // n_ptiles
        b, ch = bc // DC, bc % DC
        w = tl.load(WN3 + bc * 16 + tl.arange(0, 16))
        offs_p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        _conv_tile(Q2, O2, b * sq2b + ch * sq2c, b * so2b + ch * so2c, w, sq2h, sq2w, so2h, so2w, Hh, Ww, offs_p,
                   1.0, False)


# ----------------------------------------------------------------------------------------------- backward
@jit_sizes
def _bwd_apply(Q1, DO1, WN, DQ1, Q2, DO2, WN3, DQ2, P, PC, DW, DW3, CS, SN,
               sq1b, sq1h, sq1n, sq1d, sd1b, sd1h, sd1n, sd1d, sx1b, sx1h, sx1n, sx1d,
               sq2b, sq2c, sq2h, sq2w, sd2b, sd2c, sd2h, sd2w, sx2b, sx2c, sx2h, sx2w, stn,
               HEADS, N, D, DC, Hh, Ww, n_chunks, n_pchunks, n_sw, n_wb,
               KIND: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_P: tl.constexpr, PREC: tl.constexpr, ROPE: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # dy = df/dy (dO); dq = dy W'^T; partial of dW' = q^T dy; the first chunk zeroes its dW
        bh, chunk = pid // n_chunks, pid % n_chunks
        b, h = bh // HEADS, bh % HEADS
        offs_d = tl.arange(0, BLOCK_D)
        if (chunk == 0) & (b < n_wb):
            zero = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
            _st(DW, (b * HEADS + h) * D * D, zero, offs_d, offs_d, D, 1, D, D)
            _st(DW, ((n_wb + b) * HEADS + h) * D * D, zero, offs_d, offs_d, D, 1, D, D)
        wn1 = _ld(WN, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D)
        if KIND != LINEAR:
            wn2 = _ld(WN, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D)
        p1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        p2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            q = _ld(Q1, b * sq1b + h * sq1h, offs_n, offs_d, sq1n, sq1d, N, D)
            if ROPE:
                q = _rope(q.to(tl.float32), CS, SN, h, offs_n, stn, N, D, 1.0, BLOCK_D).to(Q1.dtype.element_ty)
            do = _ld(DO1, b * sd1b + h * sd1h, offs_n, offs_d, sd1n, sd1d, N, D).to(tl.float32)
            qt = tl.trans(q)
            if KIND == LINEAR:
                dy1 = do.to(q.dtype)
                dq = _dot(dy1, tl.trans(wn1), PREC)
                p1 += _dot(qt, dy1, PREC)
            else:
                y1 = _dot(q, wn1, PREC)
                silu, dsilu, _ = _silu_parts(_dot(q, wn2, PREC))
                dy1 = (do * silu).to(q.dtype)
                dy2 = (do * y1 * dsilu).to(q.dtype)
                dq = _dot(dy1, tl.trans(wn1), PREC) + _dot(dy2, tl.trans(wn2), PREC)
                p1 += _dot(qt, dy1, PREC)
                p2 += _dot(qt, dy2, PREC)
            if ROPE:  # the cotangent of the unrotated q
                dq = _rope(dq, CS, SN, h, offs_n, stn, N, D, -1.0, BLOCK_D)
            _st(DQ1, b * sx1b + h * sx1h, dq, offs_n, offs_d, sx1n, sx1d, N, D)
        base = (bh * n_chunks + chunk) * D * 2 * D
        _st(P, base, p1, offs_d, offs_d, 2 * D, 1, D, D)
        if KIND != LINEAR:
            _st(P, base + D, p2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # dq2 = dwconv(dO2, flip(w3')) and a partial of taps(q2, dO2); the first (batch, chunk) zeroes dw3
        bc = pid - n_sw
        b, ch, chunk = bc // n_pchunks // DC, bc // n_pchunks % DC, bc % n_pchunks
        bc = bc // n_pchunks
        offs_t = tl.arange(0, 16)
        if (chunk == 0) & (b == 0):
            tl.store(DW3 + ch * 9 + offs_t, tl.zeros((16,), dtype=tl.float32), mask=offs_t < 9)
        wf = tl.load(WN3 + bc * 16 + 8 - offs_t, mask=offs_t < 9, other=0.0)
        acc = tl.zeros((16,), dtype=tl.float32)
        for t in range(TILES):
            offs_p = (chunk * TILES + t) * BLOCK_P + tl.arange(0, BLOCK_P)
            _conv_tile(DO2, DQ2, b * sd2b + ch * sd2c, b * sx2b + ch * sx2c, wf, sd2h, sd2w, sx2h, sx2w, Hh, Ww,
                       offs_p, 1.0, False)
            acc += _taps_tile(Q2, DO2, b * sq2b + ch * sq2c, b * sd2b + ch * sd2c, sq2h, sq2w, sd2h, sd2w, Hh, Ww,
                              offs_p)
        tl.store(PC + (bc * n_pchunks + chunk) * 16 + offs_t, acc)


@jit_sizes
def _bwd_finalize(P, PC, G, DG, DW, G3, DG3, DW3,
                  HEADS, D, DC, n_chunks, n_pchunks, n_sw, n_wb, lr,
                  KIND: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # one (batch, head): dW' summed, dG = N'(G)^T (-lr dW'), dW += dW'
        b, h = pid // HEADS, pid % HEADS
        offs_d = tl.arange(0, BLOCK_D)
        d1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        d2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for chunk in range(n_chunks):
            base = (pid * n_chunks + chunk) * D * 2 * D
            d1 += _ld(P, base, offs_d, offs_d, 2 * D, 1, D, D)
            if KIND != LINEAR:
                d2 += _ld(P, base + D, offs_d, offs_d, 2 * D, 1, D, D)
        base = pid * D * 2 * D
        wb = b % n_wb
        _add(DW, (wb * HEADS + h) * D * D, d1, offs_d, D)
        if NORM:
            dg1 = _colnorm_bwd(_ld(G, base, offs_d, offs_d, 2 * D, 1, D, D), -lr * d1)
        else:
            dg1 = -lr * d1
        _st(DG, base, dg1, offs_d, offs_d, 2 * D, 1, D, D)
        if KIND != LINEAR:
            _add(DW, ((n_wb + wb) * HEADS + h) * D * D, d2, offs_d, D)
        if KIND == ALL:
            if NORM:
                dg2 = _colnorm_bwd(_ld(G, base + D, offs_d, offs_d, 2 * D, 1, D, D), -lr * d2)
            else:
                dg2 = -lr * d2
            _st(DG, base + D, dg2, offs_d, offs_d, 2 * D, 1, D, D)
    else:  # one (batch, channel): dG3, dw3 += taps(q2, dO2)
        bc = pid - n_sw
        ch = bc % DC
        offs_t = tl.arange(0, 16)
        d = tl.zeros((16,), dtype=tl.float32)
        for chunk in range(n_pchunks):
            d += tl.load(PC + (bc * n_pchunks + chunk) * 16 + offs_t)
        tl.atomic_add(DW3 + ch * 9 + offs_t, d, mask=offs_t < 9, sem="relaxed")
        if NORM:
            g = tl.load(G3 + bc * 16 + offs_t, mask=offs_t < 9, other=0.0)
            n = tl.sqrt(tl.sum(g * g, axis=0))
            dot = tl.sum(-lr * d * g, axis=0)
            coef = tl.where(n > 0, dot / (tl.maximum(n, 1e-30) * (n + 1.0) * (n + 1.0)), 0.0)
            d = -lr * d / (n + 1.0) - g * coef
        else:
            d = -lr * d
        tl.store(DG3 + bc * 16 + offs_t, d)


@jit_sizes
def _bwd_update(K1, V1, W1, W2, DG, DK1, DV1, DW, K2, V2, DG3, DK2, DV2, CS, SN,
                sk1b, sk1h, sk1n, sk1d, sv1b, sv1h, sv1n, sv1d, swb, swh, swr, swc,
                sxkb, sxkh, sxkn, sxkd, sxvb, sxvh, sxvn, sxvd,
                sk2b, sk2c, sk2h, sk2w, sv2b, sv2c, sv2h, sv2w,
                syk2b, syk2c, syk2h, syk2w, syv2b, syv2c, syv2h, syv2w, stn,
                HEADS, N, D, DC, Hh, Ww, n_chunks, n_ptiles, n_sw, n_wb, c,
                KIND: tl.constexpr, SHARE: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, PREC: tl.constexpr, ROPE: tl.constexpr):
    pid = pid64(0)
    if pid < n_sw:  # dk, dv from dG (G = c k^T A); dW += k^T dz over TILES token tiles
        bh, chunk = pid // n_chunks, pid % n_chunks
        b, h = bh // HEADS, bh % HEADS
        offs_d = tl.arange(0, BLOCK_D)
        wbase = b * swb + h * swh
        act = K1.dtype.element_ty  # dG cast once to the dots' operand dtype (fewer registers than fp32 tiles)
        dg1, s1 = _unit(_ld(DG, bh * D * 2 * D, offs_d, offs_d, 2 * D, 1, D, D))
        dg1 = dg1.to(act)
        c1 = c * s1
        if KIND == ALL:
            dg2, s2 = _unit(_ld(DG, bh * D * 2 * D + D, offs_d, offs_d, 2 * D, 1, D, D))
            dg2 = dg2.to(act)
            c2 = c * s2
        dw1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        dw2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
        for t in range(TILES):
            offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            k = _ld(K1, b * sk1b + h * sk1h, offs_n, offs_d, sk1n, sk1d, N, D)
            if ROPE:
                k = _rope(k.to(tl.float32), CS, SN, h, offs_n, stn, N, D, 1.0, BLOCK_D).to(K1.dtype.element_ty)
            v = _ld(V1, b * sv1b + h * sv1h, offs_n, offs_d, sv1n, sv1d, N, D).to(tl.float32)
            kt = tl.trans(k)
            da1 = _dot(k, dg1, PREC) * c1                     # dA (first block) = c k dG
            if KIND == LINEAR:                                 # A = v
                _st(DV1, b * sxvb + h * sxvh, da1, offs_n, offs_d, sxvn, sxvd, N, D)
                dk = _dot(v.to(k.dtype), tl.trans(dg1), PREC) * c1
            else:  # dv first and stored at once (fewer live tiles), then dk and dW
                w2 = _ld(W2, wbase, offs_d, offs_d, swr, swc, D, D)
                z2 = _dot(k, w2, PREC)
                silu, dsilu, s = _silu_parts(z2)
                vd = v * dsilu
                dz2 = da1 * vd
                dv = da1 * silu
                if KIND == ALL:
                    w1 = _ld(W1, wbase, offs_d, offs_d, swr, swc, D, D)
                    z1 = _dot(k, w1, PREC)
                    da2 = _dot(k, dg2, PREC) * c2
                    _st(DV1, b * sxvb + h * sxvh, dv + da2 * z1 * dsilu, offs_n, offs_d, sxvn, sxvd, N, D)
                    dz1 = (da2 * vd).to(k.dtype)
                    dz2 += da2 * v * z1 * (s * (1.0 - s) * (2.0 + z2 * (1.0 - 2.0 * s)))
                    dk = _dot((z1 * vd).to(k.dtype), tl.trans(dg2), PREC) * c2 + _dot(dz1, tl.trans(w1), PREC)
                    dw1 += _dot(kt, dz1, PREC)
                    dk += _dot((v * silu).to(k.dtype), tl.trans(dg1), PREC) * c1
                else:
                    _st(DV1, b * sxvb + h * sxvh, dv, offs_n, offs_d, sxvn, sxvd, N, D)
                    dk = _dot((v * silu).to(k.dtype), tl.trans(dg1), PREC) * c1
                dz2 = dz2.to(k.dtype)
                dk += _dot(dz2, tl.trans(w2), PREC)
                dw2 += _dot(kt, dz2, PREC)
            if ROPE:  # the cotangent of the unrotated k
                dk = _rope(dk, CS, SN, h, offs_n, stn, N, D, -1.0, BLOCK_D)
            if SHARE:  # q is k: the dq the first launch wrote into these rows (already turned back)
                dk += _ld(DK1, b * sxkb + h * sxkh, offs_n, offs_d, sxkn, sxkd, N, D).to(tl.float32)
            _st(DK1, b * sxkb + h * sxkh, dk, offs_n, offs_d, sxkn, sxkd, N, D)
        wb = b % n_wb
        if KIND == ALL:
            _add(DW, (wb * HEADS + h) * D * D, dw1, offs_d, D)
        if KIND != LINEAR:
            _add(DW, ((n_wb + wb) * HEADS + h) * D * D, dw2, offs_d, D)
    else:  # one pixel tile: dk2 = c dwconv(v2, flip(dG3)), dv2 = c dwconv(k2, dG3)
        bc = pid - n_sw
        tile = bc % n_ptiles
        bc = bc // n_ptiles
        b, ch = bc // DC, bc % DC
        offs_t = tl.arange(0, 16)
        dg = tl.load(DG3 + bc * 16 + offs_t, mask=offs_t < 9, other=0.0)
        dgf = tl.load(DG3 + bc * 16 + 8 - offs_t, mask=offs_t < 9, other=0.0)
        offs_p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        _conv_tile(V2, DK2, b * sv2b + ch * sv2c, b * syk2b + ch * syk2c, dgf, sv2h, sv2w, syk2h, syk2w, Hh, Ww,
                   offs_p, c, SHARE)
        _conv_tile(K2, DV2, b * sk2b + ch * sk2c, b * syv2b + ch * syv2c, dg, sk2h, sk2w, syv2h, syv2w, Hh, Ww,
                   offs_p, c, False)


# ------------------------------------------------------------------------------------------------ launchers
# warps per ("kernel:kind", activation dtype, padded head dim) where the default 8 spills on sm_90 (ptxas -v of the
# models' launches, experiments/compile_kernels.py): the table ``vit3_ttt.fused.launch_cfg`` reads for this core
WARPS = {("_bwd_update:last", torch.float32, 64): 16}  # 8: 255 registers, 156 bytes spilled (vit3_small_v1)


def _sizes(q1, q2, kind):
    b, heads, n, d = q1.shape
    bd = block_d(d)
    bn, _ = launch_cfg(bd, q1.dtype, warps=WARPS)
    return (b, heads, n, d, q2.shape[2], q2.shape[3], bd, bn,
            lambda kernel: launch_cfg(bd, q1.dtype, f"{kernel}:{kind}", warps=WARPS)[1])


def variant_fused_fwd(q1, k1, v1, q2, k2, v2, w1, w2, w3, scale: float, normalize: bool, kind: str, lr: float,
                      cos=None, sin=None):
    """(out (B, N, heads d + d) in q1's dtype, G, W' (B, heads, d, 2d) fp32, G3, W3' (B, d, 16) fp32) in 3 launches.
    ``w2`` is None for the linear inner model; q1 may be k1 (share_qk).  With H-ViT3's RoPE tables ``cos``, ``sin``,
    q1 and k1 are turned as the kernels load them."""
    b, heads, n, d, hh, ww, bd, bn, warps = _sizes(q1, q2, kind)
    cs, sn, stn, rope = _rope_args(cos, sin, q1)
    c, prec, dev, f32, kid = -scale / n, dot_prec(q1.dtype), q1.device, torch.float32, KINDS[kind]
    w2 = w1 if w2 is None else w2  # never loaded by the linear kernels
    chunks, pchunks = triton.cdiv(n, TILES * bn), triton.cdiv(n, TILES * BLOCK_P)
    part = torch.empty(b * heads, chunks, d, 2 * d, device=dev, dtype=f32)
    part3 = torch.empty(b * d, pchunks, 16, device=dev, dtype=f32)
    n_sw = b * heads * chunks
    _fwd_update[(n_sw + b * d * pchunks,)](
        k1, v1, w1, w2, k2, v2, part, part3, cs, sn, *k1.stride(), *v1.stride(), *wstrides(w1), *k2.stride(),
        *v2.stride(), stn, heads, n, d, d, hh, ww, chunks, pchunks, n_sw,
        KIND=kid, TILES=TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=BLOCK_P, PREC=prec, ROPE=rope,
        num_warps=warps("_fwd_update"))
    g = torch.empty(b, heads, d, 2 * d, device=dev, dtype=f32)
    wn = torch.empty_like(g)
    g3 = torch.empty(b, d, 16, device=dev, dtype=f32)
    wn3 = torch.empty_like(g3)
    _fwd_finalize[(b * heads + b * d,)](
        part, part3, w1, w2, w3, g, wn, g3, wn3, *wstrides(w1), w3.stride(0), w3.stride(3),
        heads, d, d, chunks, pchunks, b * heads, c, float(lr), KIND=kid, NORM=bool(normalize), BLOCK_D=bd,
        num_warps=warps("_fwd_finalize"))
    out = torch.empty(b, n, heads * d + d, device=dev, dtype=q1.dtype)
    o1 = out[..., :heads * d].unflatten(-1, (heads, d)).transpose(1, 2)
    o2 = out[..., heads * d:].transpose(1, 2).unflatten(-1, (hh, ww))
    tiles, ptiles = triton.cdiv(n, bn), triton.cdiv(n, BLOCK_P)
    n_sw = b * heads * tiles
    _fwd_apply[(n_sw + b * d * ptiles,)](
        q1, wn, o1, q2, wn3, o2, cs, sn, *q1.stride(), *o1.stride(), *q2.stride(), *o2.stride(), stn,
        heads, n, d, d, hh, ww, tiles, ptiles, n_sw, KIND=kid, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=BLOCK_P, PREC=prec,
        ROPE=rope, num_warps=warps("_fwd_apply"))
    return out, g, wn, g3, wn3


def variant_fused_bwd(dout, q1, k1, v1, q2, k2, v2, w1, w2, w3, g, wn, g3, wn3, scale: float, normalize: bool,
                      kind: str, lr: float, share_qk: bool, cos=None, sin=None):
    """(dqkv (B, N, 3 heads d + 3 d), or 2 heads d + 2 d with ``share_qk``, in q1's dtype; dw1, dw2 (w1's shape,
    fp32; dw2 None for the linear inner model), dw3 (d, 1, 3, 3) fp32) in 3 launches; ``dout`` any strides.  With the
    forward's RoPE tables, q1 and k1 are turned as loaded and their cotangents turned back."""
    b, heads, n, d, hh, ww, bd, bn, warps = _sizes(q1, q2, kind)
    cs, sn, stn, rope = _rope_args(cos, sin, q1)
    cc = heads * d
    c, prec, dev, f32, kid = -scale / n, dot_prec(q1.dtype), q1.device, torch.float32, KINDS[kind]
    w2_ = w1 if w2 is None else w2
    chunks, pchunks, ptiles = triton.cdiv(n, TILES * bn), triton.cdiv(n, TILES * BLOCK_P), triton.cdiv(n, BLOCK_P)
    nq = 2 if share_qk else 3  # slots: (q,) k, v of each branch; q's gradient goes into k's slot when shared
    dqkv = torch.empty(b, n, nq * (cc + d), device=dev, dtype=q1.dtype)
    dx1 = [dqkv[..., i * cc:(i + 1) * cc].unflatten(-1, (heads, d)).transpose(1, 2) for i in range(nq)]
    dx2 = [dqkv[..., nq * cc + i * d:nq * cc + (i + 1) * d].transpose(1, 2).unflatten(-1, (hh, ww))
           for i in range(nq)]
    if share_qk:  # (dq, dk, dv) targets: dq and dk both into the key rows
        dx1, dx2 = [dx1[0]] + dx1, [dx2[0]] + dx2
    do1 = dout[..., :cc].unflatten(-1, (heads, d)).transpose(1, 2)
    do2 = dout[..., cc:].transpose(1, 2).unflatten(-1, (hh, ww))
    n_wb = w1.shape[0]
    dw = torch.empty(2, n_wb, heads, d, d, device=dev, dtype=f32)   # zeroed by the first launch
    dw3 = torch.empty(d, 1, 3, 3, device=dev, dtype=f32)
    part = torch.empty(b * heads, chunks, d, 2 * d, device=dev, dtype=f32)
    part3 = torch.empty(b * d, pchunks, 16, device=dev, dtype=f32)
    n_sw = b * heads * chunks
    _bwd_apply[(n_sw + b * d * pchunks,)](
        q1, do1, wn, dx1[0], q2, do2, wn3, dx2[0], part, part3, dw, dw3, cs, sn, *q1.stride(), *do1.stride(),
        *dx1[0].stride(), *q2.stride(), *do2.stride(), *dx2[0].stride(), stn, heads, n, d, d, hh, ww, chunks,
        pchunks, n_sw, n_wb, KIND=kid, TILES=TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=BLOCK_P, PREC=prec, ROPE=rope,
        num_warps=warps("_bwd_apply"))
    dg = torch.empty(b, heads, d, 2 * d, device=dev, dtype=f32)
    dg3 = torch.empty(b, d, 16, device=dev, dtype=f32)
    _bwd_finalize[(b * heads + b * d,)](
        part, part3, g, dg, dw, g3, dg3, dw3, heads, d, d, chunks, pchunks, b * heads, n_wb, float(lr),
        KIND=kid, NORM=bool(normalize), BLOCK_D=bd, num_warps=warps("_bwd_finalize"))
    _bwd_update[(n_sw + b * d * ptiles,)](
        k1, v1, w1, w2_, dg, dx1[1], dx1[2], dw, k2, v2, dg3, dx2[1], dx2[2], cs, sn,
        *k1.stride(), *v1.stride(), *wstrides(w1), *dx1[1].stride(), *dx1[2].stride(), *k2.stride(), *v2.stride(),
        *dx2[1].stride(), *dx2[2].stride(), stn, heads, n, d, d, hh, ww, chunks, ptiles, n_sw, n_wb, c,
        KIND=kid, SHARE=bool(share_qk), TILES=TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=BLOCK_P, PREC=prec, ROPE=rope,
        num_warps=warps("_bwd_update"))
    return dqkv, dw[0], None if w2 is None else dw[1], dw3
