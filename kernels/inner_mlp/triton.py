"""Triton kernels of the T5 (gated SwiGLU, dot-product loss) and DiT5 (SiLU MLP, regression loss) inner steps:
3 launches forward and 3 backward per call (2 and 2 at N <= 256), no PyTorch op in between.

One kernel family for both inner models; ``GATED`` (constexpr) switches between them (``torch.py`` documents the
formulas, which these kernels follow).  Weight slots: A = W1, B = W2 (gated only), O = the output layer (T5: W3,
DiT5: W2).  q, k, v may be any strided (B, heads, N, d) views (the heads split of the qkv output is never copied).
Activations are loaded in their own dtype and every ``tl.dot`` runs on that dtype (tensor cores for fp16/bf16; fp32
as ``triton_utils.dot_prec`` says) with fp32 accumulation; every elementwise step and reduction is fp32.  d is
padded to a power of two D >= 16 and masked; N is tiled and masked.  Offsets are 64-bit (from the program id); the
sizes that change per image (N, the chunk / tile counts, the weights' batch) are not specialised.

The inner loss gradient e = c e~ is carried unscaled (T5 e~ = v, c = -scale / N; DiT5 e~ = f - v, c = scale / N)
and c is applied to the d x d sums in the finalize kernels, so no fp16 product goes subnormal at large N.
Forward (per (batch, head); the partials P and cotangents CT: fp32 (n_w, B heads, ...) buffers; W' and dW one
fp32 tensor per weight, as the custom op's outputs may not alias):
  1. ``_fwd_update``: partial sums S of the inner gradients over chunks of TILES * BLOCK_N tokens.
  2. ``_fwd_finalize``: per (batch, head, column block): G = c sum(S), W' = W - G (saved for the backward).
  3. ``_fwd_apply``: out = silu(q W1') [* q W2'] O' into a heads-merged (B, N, heads, d) buffer; with a ``mix``
     input (T5+ / DiT5: the neighbourhood-attention half) out = (1 - a) out + a mix, its grads in 4.
Backward (dO given):
  4. ``_bwd_apply``: recomputes y = q W', writes dq, partials of dW' = q^T dy (and zeroes dW); with ``mix``,
     dO -> (1 - a) dO and d mix = a dO.
  5. ``_bwd_finalize``: per (batch, head, column block): dW' summed over chunks, CT = -c dW' (the cotangent of S),
     dW += dW' (relaxed atomic add: per-sample weights get one add, shared weights one per sample).
  6. ``_bwd_update``: recomputes z, silu, silu', silu'', h, e~ from k, v, W; writes dk, dv; dW += its chunk's
     gradient through S (relaxed atomic add, no fences: sums in fp32, their order may vary from run to run).
     Under ``torch.use_deterministic_algorithms`` 5 and 6 store their parts instead and a fourth launch,
     ``_bwd_reduce``, sums them in a fixed order (bitwise reproducible).
One chunk per (batch, head) (N <= TILES * BLOCK_N = 256 tokens: every T5 model at 224 px; a runtime branch on
``n_chunks``, not a constexpr: one compiled variant for every size): ``_fwd_update`` writes W' itself and
``_bwd_apply`` writes CT and each sample's dW' (``_bwd_update`` adds it to dW): 2 launches forward, 2 backward
(3 deterministic).
Extra memory: the fp32 partials (n_w d x d per chunk), W' and CT (n_w d x d per (batch, head)); nothing of size
N x d beyond the outputs.  Every program holds whole d x d weights: ``backend.MAX_HEAD_DIM`` caps d at what
``experiments/compile_kernels.py`` compiled for sm_90 without spills.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ..backend import MAX_HEAD_DIM
from ..triton_utils import load_tile_raw as _ld, store_tile as _st, atomic_add_mat as _add, dot_acc as _dot
from ..triton_utils import block_d as _block_d, dot_prec, wstrides as _wstrides
from .torch import _check, make_function, model_entry_points

__all__ = ["inner_fwd_triton", "inner_bwd_triton", "t5_fwd_triton", "t5_bwd_triton", "dit5_fwd_triton",
           "dit5_bwd_triton", "t5_swiglu_ttt_triton", "mlp_ttt_triton", "launch_cfg"]

BLOCK_N = 64      # the longest token tile
TILES = 4         # tiles reduced per program in the reducing launches (chunks of TILES * BLOCK_N tokens)
BLOCK_C = 32      # columns per finalize program
_SIZES = ("N", "n_bh", "n_chunks", "n_tiles", "n_wb", "per")  # vary per input: one compiled variant serves every size


def bwd_tuning(kernel: str, bd: int, fp32: bool) -> Tuple[int, int]:
    """(num_stages, SPLIT) of ``_bwd_apply`` / ``_bwd_update``: fp32's FMA dots at d = 64 spilled on sm_90 (up to
    12 KB a thread; experiments/compile_kernels.py), so there some d-long dots run as two half-length ones
    (:func:`_mm`: ``_bwd_apply``'s hidden-layer dots, ``_bwd_update``'s derivative dots, where ptxas measured it
    to help) and the loops pipeline fewer stages; 16-bit and smaller d: Triton's defaults."""
    if not fp32 or bd < 64:
        return 3, 1
    return {"_bwd_apply": (1, 2), "_bwd_update": (2, 2)}[kernel]


def launch_cfg(bd: int, pass_: str, fp32: bool = False):
    """(token tile, tiles per chunk, warps) of a pass ("apply", "update", "bwd") at padded head dim ``bd``, for fp32
    or 16-bit activations: the one place that picks them, from the sm_90 ptxas report
    (experiments/results/sm90_launched.md; fp32's IEEE dots hold the most registers: 16-token tiles)."""
    if fp32:
        cap = 16
    elif bd <= 32:
        cap = {"apply": 64, "update": 64, "bwd": 32}[pass_]
    else:
        cap = {"apply": 64, "update": 32, "bwd": 16}[pass_]
    bn = min(BLOCK_N, cap)
    return bn, max(1, TILES * BLOCK_N // bn), 8 if fp32 or bd > 32 else 4


# ------------------------------------------------------------------------------------------- shared helpers


@triton.jit
def _weights(WA, WB, WO, ba, bb, bo, sr, sc, offs_d, D, dt: tl.constexpr, GATED: tl.constexpr):
    """The 2 (MLP) or 3 (gated) d x d weights of one (batch, head) in the activations' dtype (wb = wa if not
    gated, unused); ``sr``, ``sc``: row and column strides shared by the three."""
    wa = _ld(WA, ba, offs_d, offs_d, sr, sc, D, D).to(dt)
    wo = _ld(WO, bo, offs_d, offs_d, sr, sc, D, D).to(dt)
    if GATED:
        wb = _ld(WB, bb, offs_d, offs_d, sr, sc, D, D).to(dt)
    else:
        wb = wa
    return wa, wb, wo


@triton.jit
def _halves(x, w):
    """x's column halves and w's row halves (x @ w = x0 @ w0 + x1 @ w1)."""
    half: tl.constexpr = x.shape[1] // 2
    x0, x1 = tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, half)), (0, 2, 1)))
    w0, w1 = tl.split(tl.permute(tl.reshape(w, (2, half, w.shape[1])), (1, 2, 0)))
    return x0, x1, w0, w1


@triton.jit
def _mm(x, w, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """x @ w (x: tokens x d, w: d x d, both in registers), fp32 accumulation; ``SPLIT`` = 2: as two dots over the
    halves of d (an fp32 FMA dot holds its operands' whole d-long rows and columns in each thread: half as many)."""
    if SPLIT == 1:
        out = _dot(x, w, PREC)
    else:
        half: tl.constexpr = x.shape[1] // 2
        x0, x1 = tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, half)), (0, 2, 1)))
        w0, w1 = tl.split(tl.permute(tl.reshape(w, (2, half, w.shape[1])), (1, 2, 0)))
        out = _dot(x0, w0, PREC) + _dot(x1, w1, PREC)
    return out


@triton.jit
def _hidden(x, wa, wb, GATED: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr = 1):
    """z1 = x A, silu(z1), silu'(z1), sigmoid(z1), the gate z2 = x B (or z1) and the hidden h, all fp32."""
    z1 = _mm(x, wa, PREC, SPLIT)
    s = tl.sigmoid(z1)
    a = z1 * s
    da = s + a * (1.0 - s)
    if GATED:
        z2 = _mm(x, wb, PREC, SPLIT)
        h = a * z2
    else:
        z2 = z1
        h = a
    return z1, a, da, s, z2, h


@triton.jit
def _residual(h, v, wo, GATED: tl.constexpr, PREC: tl.constexpr):
    """e~ = dL/df / c: T5 v, DiT5 h O - v (fp32)."""
    if GATED:
        e = v.to(tl.float32)
    else:
        e = _dot(h.to(wo.dtype), wo, PREC) - v.to(tl.float32)
    return e


@triton.jit
def _zeros3(BLOCK_D: tl.constexpr):
    shape: tl.constexpr = (BLOCK_D, BLOCK_D)
    return tl.zeros(shape, dtype=tl.float32), tl.zeros(shape, dtype=tl.float32), tl.zeros(shape, dtype=tl.float32)


@triton.jit
def _store3(P, base, stride_w, ga, gb, go, offs_d, D, GATED: tl.constexpr):
    """The A, (B,) O blocks into a contiguous (n_w, ..., d, d) fp32 buffer (weight w at base + w stride_w)."""
    _st(P, base, ga, offs_d, offs_d, D, 1, D, D)
    if GATED:
        _st(P, base + stride_w, gb, offs_d, offs_d, D, 1, D, D)
        _st(P, base + 2 * stride_w, go, offs_d, offs_d, D, 1, D, D)
    else:
        _st(P, base + stride_w, go, offs_d, offs_d, D, 1, D, D)


@triton.jit
def _store3p(PA, PB, PO, base, ga, gb, go, offs_d, D, GATED: tl.constexpr):
    """The A, (B,) O blocks into three contiguous d x d fp32 buffers at the same offset."""
    _st(PA, base, ga, offs_d, offs_d, D, 1, D, D)
    _st(PO, base, go, offs_d, offs_d, D, 1, D, D)
    if GATED:
        _st(PB, base, gb, offs_d, offs_d, D, 1, D, D)


@triton.jit
def _program(H, n_per_bh):
    """(batch, head, b * H + h, chunk or tile) of this program, in int64."""
    pid = tl.program_id(0).to(tl.int64)
    bh = pid // n_per_bh
    return bh // H, bh % H, bh, pid % n_per_bh


# ------------------------------------------------------------------------------------------------ forward
@triton.jit(do_not_specialize=_SIZES)
def _fwd_update(K, V, WA, WB, WO, P, NA, NB, NO,
                skb, skh, skn, skd, svb, svh, svn, svd, swab, swbb, swob, swh, swr, swc,
                H, N, D, n_bh, n_chunks, c,
                GATED: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                PREC: tl.constexpr):
    """Partial sums S (the inner gradients / c) over TILES token tiles: S_A = k^T (dh [z2] silu'(z1)), S_B = k^T
    (dh silu(z1)), S_O = h^T e~, with dh = e~ O^T.  With one chunk per (batch, head) the program holds
    the whole sum and writes W' = W - c S into NA, NB, NO itself (no partials, no finalize launch)."""
    b, h, bh, chunk = _program(H, n_chunks)
    dt: tl.constexpr = K.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    wa, wb, wo = _weights(WA, WB, WO, b * swab + h * swh, b * swbb + h * swh, b * swob + h * swh, swr, swc, offs_d,
                          D, dt, GATED)
    ga, gb, go = _zeros3(BLOCK_D)
    for t in range(TILES):
        offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        x = _ld(K, b * skb + h * skh, offs_n, offs_d, skn, skd, N, D)
        y = _ld(V, b * svb + h * svh, offs_n, offs_d, svn, svd, N, D)
        z1, a, da, s, z2, hid = _hidden(x, wa, wb, GATED, PREC)
        e = _residual(hid, y, wo, GATED, PREC)
        dh = _dot(e.to(dt), tl.trans(wo), PREC)
        xt = tl.trans(x)
        if GATED:
            dya = dh * z2 * da
            gb += _dot(xt, (dh * a).to(dt), PREC)
        else:
            dya = dh * da
        ga += _dot(xt, dya.to(dt), PREC)
        go += _dot(tl.trans(hid.to(dt)), e.to(dt), PREC)
    if n_chunks == 1:  # one chunk (a runtime branch: one compiled variant for every size)
        nb = bh * D * D
        _new_weight(WA, NA, b * swab + h * swh, nb, swr, swc, ga, c, offs_d, D)
        _new_weight(WO, NO, b * swob + h * swh, nb, swr, swc, go, c, offs_d, D)
        if GATED:
            _new_weight(WB, NB, b * swbb + h * swh, nb, swr, swc, gb, c, offs_d, D)
    else:
        _store3(P, (bh * n_chunks + chunk) * D * D, n_bh * n_chunks * D * D, ga, gb, go, offs_d, D, GATED)


@triton.jit
def _new_weight(W, WN, wbase, nbase, swr, swc, g, c, offs_d, D):
    """W' = W - c g of one whole d x d weight (fp32; c applied to the fp32 sum)."""
    w = _ld(W, wbase, offs_d, offs_d, swr, swc, D, D).to(tl.float32)
    _st(WN, nbase, w - g * c, offs_d, offs_d, D, 1, D, D)


@triton.jit
def _finalize_one(P, W, WN, pbase, pstride, wbase, nbase, swr, swc, offs_r, offs_c, D, n_chunks, c,
                  BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """W' = W - c sum over chunks of the partials (one column block of one weight)."""
    acc = tl.zeros((BLOCK_D, BLOCK_C), dtype=tl.float32)
    for chunk in range(n_chunks):
        acc += _ld(P, pbase + chunk * pstride, offs_r, offs_c, D, 1, D, D)
    w = _ld(W, wbase, offs_r, offs_c, swr, swc, D, D).to(tl.float32)
    _st(WN, nbase, w - acc * c, offs_r, offs_c, D, 1, D, D)


@triton.jit(do_not_specialize=_SIZES)
def _fwd_finalize(P, WA, WB, WO, NA, NB, NO,
                  swab, swbb, swob, swh, swr, swc,
                  H, D, n_bh, n_chunks, n_cols, c,
                  GATED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """One column block of every weight of one (batch, head): W' = W - c sum(P[w, bh, :]) into NA, NB, NO."""
    b, h, bh, cb = _program(H, n_cols)
    offs_r = tl.arange(0, BLOCK_D)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    dd = D * D
    pb, nb, pw = bh * n_chunks * dd, bh * dd, n_bh * n_chunks * dd
    _finalize_one(P, WA, NA, pb, dd, b * swab + h * swh, nb, swr, swc,
                  offs_r, offs_c, D, n_chunks, c, BLOCK_D, BLOCK_C)
    if GATED:
        _finalize_one(P, WB, NB, pb + pw, dd, b * swbb + h * swh, nb, swr, swc,
                      offs_r, offs_c, D, n_chunks, c, BLOCK_D, BLOCK_C)
        _finalize_one(P, WO, NO, pb + 2 * pw, dd, b * swob + h * swh, nb, swr, swc,
                      offs_r, offs_c, D, n_chunks, c, BLOCK_D, BLOCK_C)
    else:
        _finalize_one(P, WO, NO, pb + pw, dd, b * swob + h * swh, nb, swr, swc,
                      offs_r, offs_c, D, n_chunks, c, BLOCK_D, BLOCK_C)


@triton.jit(do_not_specialize=_SIZES)
def _fwd_apply(Q, NA, NB, NO, O, MIX,
               sqb, sqh, sqn, sqd, sob, soh, son, sod, smb, smh, smn, smd,
               H, N, D, n_bh, n_tiles, alpha,
               GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
               HAS_MIX: tl.constexpr):
    """One token tile of one (batch, head): out = silu(q A') [* q B'] O'; ``HAS_MIX``: out = (1 - a) out + a mix
    (a = ``alpha``, in fp32, one rounding)."""
    b, h, bh, tile = _program(H, n_tiles)
    dt: tl.constexpr = Q.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    wa, wb, wo = _weights(NA, NB, NO, bh * D * D, bh * D * D, bh * D * D, D, 1, offs_d, D, dt, GATED)
    q = _ld(Q, b * sqb + h * sqh, offs_n, offs_d, sqn, sqd, N, D)
    z1, a, da, s, z2, hid = _hidden(q, wa, wb, GATED, PREC)
    out = _dot(hid.to(dt), wo, PREC)
    if HAS_MIX:
        mix = _ld(MIX, b * smb + h * smh, offs_n, offs_d, smn, smd, N, D).to(tl.float32)
        out = out * (1.0 - alpha) + mix * alpha
    _st(O, b * sob + h * soh, out, offs_n, offs_d, son, sod, N, D)


# ----------------------------------------------------------------------------------------------- backward
@triton.jit(do_not_specialize=_SIZES)
def _bwd_apply(Q, DO, WA, WB, WO, DQ, P, DWA, DWB, DWO, CT, SP, DMIX,
               sqb, sqh, sqn, sqd, sdb, sdh, sdn, sdd, sxb, sxh, sxn, sxd, smb, smh, smn, smd,
               H, N, D, n_bh, n_chunks, n_wb, c, alpha,
               GATED: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               PREC: tl.constexpr, HAS_MIX: tl.constexpr, SPLIT: tl.constexpr = 1):
    """dq = dy W'^T and partials of dW' = q^T dy (dy the cotangent of q W'), over TILES tiles; the first chunk of
    the first n_wb batches zeroes dW (DWA, DWB, DWO: (n_wb, heads, d, d)) for the next launches' atomic adds.
    With one chunk the whole dW' is here, so the finalize's work is done here: CT = -c dW', SP = dW'.
    ``HAS_MIX`` (the forward blended out = (1 - a) apply + a mix): dmix = a dO is written here and the apply's
    cotangent is (1 - a) dO (scaled in fp32)."""
    b, h, bh, chunk = _program(H, n_chunks)
    dt: tl.constexpr = Q.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    dd = D * D
    wa, wb, wo = _weights(WA, WB, WO, bh * dd, bh * dd, bh * dd, D, 1, offs_d, D, dt, GATED)
    ga, gb, go = _zeros3(BLOCK_D)
    if (chunk == 0) & (b < n_wb):
        _store3p(DWA, DWB, DWO, bh * dd, ga, gb, go, offs_d, D, GATED)
    for t in range(TILES):
        offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        x = _ld(Q, b * sqb + h * sqh, offs_n, offs_d, sqn, sqd, N, D)
        y = _ld(DO, b * sdb + h * sdh, offs_n, offs_d, sdn, sdd, N, D)
        if HAS_MIX:
            yf = y.to(tl.float32)
            _st(DMIX, b * smb + h * smh, yf * alpha, offs_n, offs_d, smn, smd, N, D)
            y = yf * (1.0 - alpha)
        y = y.to(dt)
        z1, a, da, s, z2, hid = _hidden(x, wa, wb, GATED, PREC, SPLIT)
        dh = _dot(y, tl.trans(wo), PREC)
        xt = tl.trans(x)
        if GATED:
            dya = (dh * z2 * da).to(dt)
            dyb = (dh * a).to(dt)
            gb += _dot(xt, dyb, PREC)
            dx = _dot(dya, tl.trans(wa), PREC) + _dot(dyb, tl.trans(wb), PREC)
        else:
            dya = (dh * da).to(dt)
            dx = _dot(dya, tl.trans(wa), PREC)
        ga += _dot(xt, dya, PREC)
        go += _dot(tl.trans(hid.to(dt)), y, PREC)
        _st(DQ, b * sxb + h * sxh, dx, offs_n, offs_d, sxn, sxd, N, D)
    if n_chunks == 1:
        _store3(CT, bh * dd, n_bh * dd, ga * -c, gb * -c, go * -c, offs_d, D, GATED)
        _store3(SP, bh * dd, n_bh * dd, ga, gb, go, offs_d, D, GATED)
    else:
        _store3(P, (bh * n_chunks + chunk) * dd, n_bh * n_chunks * dd, ga, gb, go, offs_d, D, GATED)


@triton.jit
def _bwd_finalize_one(P, CT, DW, SP, pbase, pstride, nbase, wbase, offs_r, offs_c, D, n_chunks, c,
                      BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """One column block of one weight: dW' summed over chunks; CT = -c dW'; dW += dW' (relaxed), or dW' stored
    into SP for ``_bwd_reduce`` (deterministic)."""
    acc = tl.zeros((BLOCK_D, BLOCK_C), dtype=tl.float32)
    for chunk in range(n_chunks):
        acc += _ld(P, pbase + chunk * pstride, offs_r, offs_c, D, 1, D, D)
    _st(CT, nbase, acc * -c, offs_r, offs_c, D, 1, D, D)
    if DETERMINISTIC:
        _st(SP, nbase, acc, offs_r, offs_c, D, 1, D, D)
    else:
        m = (offs_r[:, None] < D) & (offs_c[None, :] < D)
        tl.atomic_add(DW + wbase + offs_r[:, None] * D + offs_c[None, :], acc, mask=m, sem="relaxed")


@triton.jit(do_not_specialize=_SIZES)
def _bwd_finalize(P, CT, DWA, DWB, DWO, SP, H, D, n_bh, n_chunks, n_cols, n_wb, c,
                  GATED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, DETERMINISTIC: tl.constexpr):
    b, h, bh, cb = _program(H, n_cols)
    offs_r = tl.arange(0, BLOCK_D)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    dd = D * D
    pb, nb, wb = bh * n_chunks * dd, bh * dd, ((b % n_wb) * H + h) * dd
    pw, nw = n_bh * n_chunks * dd, n_bh * dd
    _bwd_finalize_one(P, CT, DWA, SP, pb, dd, nb, wb,
                      offs_r, offs_c, D, n_chunks, c, BLOCK_D, BLOCK_C, DETERMINISTIC)
    if GATED:
        _bwd_finalize_one(P, CT, DWB, SP, pb + pw, dd, nb + nw, wb,
                          offs_r, offs_c, D, n_chunks, c, BLOCK_D, BLOCK_C, DETERMINISTIC)
        _bwd_finalize_one(P, CT, DWO, SP, pb + 2 * pw, dd, nb + 2 * nw, wb,
                          offs_r, offs_c, D, n_chunks, c, BLOCK_D, BLOCK_C, DETERMINISTIC)
    else:
        _bwd_finalize_one(P, CT, DWO, SP, pb + pw, dd, nb + nw, wb,
                          offs_r, offs_c, D, n_chunks, c, BLOCK_D, BLOCK_C, DETERMINISTIC)


@triton.jit(do_not_specialize=_SIZES)
def _bwd_update(K, V, WA, WB, WO, CT, DK, DV, DWA, DWB, DWO, P, SP,
                skb, skh, skn, skd, svb, svh, svn, svd, swab, swbb, swob, swh, swr, swc,
                sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
                H, N, D, n_bh, n_chunks, n_wb,
                GATED: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                PREC: tl.constexpr, DETERMINISTIC: tl.constexpr, SPLIT: tl.constexpr = 1):
    """dk, dv and this chunk's part of dW through S, given CT (the cotangents of S_A, S_B, S_O): added to dW, or
    stored into the partials P (free again after ``_bwd_finalize``) for ``_bwd_reduce`` (deterministic).
    One chunk and not deterministic: this sample's dW' (SP, from ``_bwd_apply``) is added with it."""
    b, h, bh, chunk = _program(H, n_chunks)
    dt: tl.constexpr = K.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    dd, nw = D * D, n_bh * D * D
    wa, wb, wo = _weights(WA, WB, WO, b * swab + h * swh, b * swbb + h * swh, b * swob + h * swh, swr, swc, offs_d,
                          D, dt, GATED)
    cta, ctb, cto = _weights(CT, CT, CT, bh * dd, nw + bh * dd, (1 + GATED) * nw + bh * dd, D, 1, offs_d, D, dt,
                             GATED)
    ga, gb, go = _zeros3(BLOCK_D)
    for t in range(TILES):
        offs_n = (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _ld(K, b * skb + h * skh, offs_n, offs_d, skn, skd, N, D)
        v = _ld(V, b * svb + h * svh, offs_n, offs_d, svn, svd, N, D)
        z1, a, da, s, z2, hid = _hidden(k, wa, wb, GATED, PREC)
        d2a = s * (1.0 - s) * (2.0 + z1 * (1.0 - 2.0 * s))
        e = _residual(hid, v, wo, GATED, PREC)
        e16 = e.to(dt)
        dpa = _mm(k, cta, PREC, SPLIT)
        if GATED:
            dh = _mm(e16, tl.trans(wo), PREC, SPLIT)
            dha = _mm(e16, tl.trans(cto), PREC, SPLIT)
            de = _mm(hid.to(dt), cto, PREC, SPLIT)
            dpb = _mm(k, ctb, PREC, SPLIT)
            dk = _mm((dh * z2 * da).to(dt), tl.trans(cta), PREC, SPLIT)
            dk += _mm((dh * a).to(dt), tl.trans(ctb), PREC, SPLIT)
            ddh = dpa * z2 * da + dpb * a
            dz2 = (dpa * dh * da + dha * a).to(dt)
            dz1 = (dpa * dh * z2 * d2a + dpb * dh * da + dha * z2 * da).to(dt)
            de += _mm(ddh.to(dt), wo, PREC, SPLIT)
            dv = de
            dk += _mm(dz1, tl.trans(wa), PREC, SPLIT) + _mm(dz2, tl.trans(wb), PREC, SPLIT)
            gb += _dot(tl.trans(k), dz2, PREC)
            go += _dot(tl.trans(ddh.to(dt)), e16, PREC)
        else:  # ordered so that each tile dies early (fp32 spilled on sm_90 otherwise)
            ddh = (dpa * da).to(dt)
            df = (_mm(hid.to(dt), cto, PREC, SPLIT) + _mm(ddh, wo, PREC, SPLIT)).to(dt)
            go += _dot(tl.trans(hid.to(dt)), df, PREC) + _dot(tl.trans(ddh), e16, PREC)
            dv = -df.to(tl.float32)
            dh = _mm(e16, tl.trans(wo), PREC, SPLIT)
            dz1 = (dpa * dh * d2a + (_mm(e16, tl.trans(cto), PREC, SPLIT) + _dot(df, tl.trans(wo), PREC))
                   * da).to(dt)  # this one unsplit: ptxas spilled 132 B with it split
            dk = _mm((dh * da).to(dt), tl.trans(cta), PREC, SPLIT) + _mm(dz1, tl.trans(wa), PREC, SPLIT)
        ga += _dot(tl.trans(k), dz1, PREC)
        _st(DK, b * sdkb + h * sdkh, dk, offs_n, offs_d, sdkn, sdkd, N, D)
        _st(DV, b * sdvb + h * sdvh, dv, offs_n, offs_d, sdvn, sdvd, N, D)
    if DETERMINISTIC:
        _store3(P, (bh * n_chunks + chunk) * dd, n_bh * n_chunks * dd, ga, gb, go, offs_d, D, GATED)
    else:
        if n_chunks == 1:
            ga += _ld(SP, bh * dd, offs_d, offs_d, D, 1, D, D)
            go += _ld(SP, (1 + GATED) * nw + bh * dd, offs_d, offs_d, D, 1, D, D)
            if GATED:
                gb += _ld(SP, nw + bh * dd, offs_d, offs_d, D, 1, D, D)
        wbase = ((b % n_wb) * H + h) * dd
        _add(DWA, wbase, ga, offs_d, D)
        _add(DWO, wbase, go, offs_d, D)
        if GATED:
            _add(DWB, wbase, gb, offs_d, D)


@triton.jit
def _reduce_one(P, SP, DW, pbase, pstride, sbase, H, per, n_chunks, wbase, offs_r, offs_c, D,
                BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """dW (one column block of one weight) = the sum over the weight's ``per`` batches of SP and of the chunks'
    partials, in a fixed order; ``pbase`` / ``sbase``: the first batch's, ``pstride``: one chunk's."""
    dd = D * D
    acc = tl.zeros((BLOCK_D, BLOCK_C), dtype=tl.float32)
    for i in range(per):
        acc += _ld(SP, sbase + i * H * dd, offs_r, offs_c, D, 1, D, D)
        for chunk in range(n_chunks):
            acc += _ld(P, pbase + (i * H * n_chunks + chunk) * pstride, offs_r, offs_c, D, 1, D, D)
    _st(DW, wbase, acc, offs_r, offs_c, D, 1, D, D)


@triton.jit(do_not_specialize=_SIZES)
def _bwd_reduce(P, SP, DWA, DWB, DWO, H, D, n_bh, n_chunks, n_cols, per,
                GATED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr):
    """Deterministic mode only: one column block of every dW[wb, h] (wb: the weight's batch, 0 if shared)."""
    wb, h, wbh, cb = _program(H, n_cols)
    offs_r = tl.arange(0, BLOCK_D)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    dd = D * D
    bh0 = wb * per * H + h  # the weight's first (batch, head)
    pb, sb, pw, sw = bh0 * n_chunks * dd, bh0 * dd, n_bh * n_chunks * dd, n_bh * dd
    _reduce_one(P, SP, DWA, pb, dd, sb, H, per, n_chunks, wbh * dd, offs_r, offs_c, D, BLOCK_D, BLOCK_C)
    if GATED:
        _reduce_one(P, SP, DWB, pb + pw, dd, sb + sw, H, per, n_chunks, wbh * dd, offs_r, offs_c, D, BLOCK_D,
                    BLOCK_C)
        _reduce_one(P, SP, DWO, pb + 2 * pw, dd, sb + 2 * sw, H, per, n_chunks, wbh * dd, offs_r, offs_c, D,
                    BLOCK_D, BLOCK_C)
    else:
        _reduce_one(P, SP, DWO, pb + pw, dd, sb + sw, H, per, n_chunks, wbh * dd, offs_r, offs_c, D, BLOCK_D,
                    BLOCK_C)


# ------------------------------------------------------------------------------------------------ launchers
def _slots(ws: Sequence[torch.Tensor]):
    """(A, B, O) slots: B aliases A for the 2-layer MLP (never read)."""
    return (ws[0], ws[1], ws[2]) if len(ws) == 3 else (ws[0], ws[0], ws[1])


def _wargs(ws: Sequence[torch.Tensor]):
    """Batch strides of A, B, O (0 for a shared weight), then the head, row, column strides they share."""
    a, b_, o = _slots(ws)
    sa, sb, so = _wstrides(a), _wstrides(b_), _wstrides(o)
    if not (sa[1:] == sb[1:] == so[1:]):
        raise ValueError("the inner weights must share their head, row and column strides (e.g. all contiguous); "
                         "pass .contiguous() weights")
    return (sa[0], sb[0], so[0]) + sa[1:]


def _heads_merged(b: int, h: int, n: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, d) view of a (B, N, heads, d) buffer: merging the heads afterwards is free."""
    return torch.empty(b, n, h, d, device=like.device, dtype=like.dtype).transpose(1, 2)


def _sizes(q: torch.Tensor, op: str, pass_: str):
    b, h, n, d = q.shape
    if d > MAX_HEAD_DIM[op]:  # registers / shared memory would not fit (backend.MAX_HEAD_DIM)
        raise ValueError(f"{op}: the Triton kernel takes head dims up to {MAX_HEAD_DIM[op]}, got {d}; use the "
                         f"PyTorch path (backend='torch' or 'auto')")
    bd = _block_d(d)
    bn, tiles, warps = launch_cfg(bd, pass_, q.dtype == torch.float32)
    return b, h, n, d, bd, bn, tiles, warps, triton.cdiv(n, tiles * bn)


def _op_name(gated: bool) -> str:
    return "t5_swiglu_ttt" if gated else "dit5_mlp_ttt"


def inner_fwd_triton(q, k, v, ws: Sequence[torch.Tensor], scale: float, gated: bool,
                     mix: Optional[torch.Tensor] = None, mix_weight: float = 0.0):
    """Triton forward in 3 launches: (out (B, heads, N, d) in q's dtype, [W'] fp32 (B, heads, d, d) contiguous);
    with ``mix`` (any strided (B, heads, N, d)) out = (1 - mix_weight) apply + mix_weight mix, in the apply."""
    op = _op_name(gated)
    _check(q, k, v, ws, op)
    b, h, n, d, bd, bn, tiles, warps, chunks = _sizes(q, op, "update")
    n_w, bh, prec, dev, f32 = len(ws), b * h, dot_prec(q.dtype), q.device, torch.float32
    c = (-scale if gated else scale) / n
    wargs = _wargs(ws)
    single = chunks == 1  # the update program writes W' itself: 2 launches
    wn = [torch.empty(b, h, d, d, device=dev, dtype=f32) for _ in ws]  # separate: the op's outputs never alias
    part = wn[0] if single else torch.empty(n_w, bh, chunks, d, d, device=dev, dtype=f32)
    _fwd_update[(bh * chunks,)](k, v, *_slots(ws), part, *_slots(wn), *k.stride(), *v.stride(), *wargs, h, n, d,
                                bh, chunks, c, GATED=gated, TILES=tiles, BLOCK_N=bn, BLOCK_D=bd, PREC=prec,
                                num_warps=warps)
    if not single:
        bc = min(BLOCK_C, bd)
        cols = triton.cdiv(d, bc)
        _fwd_finalize[(bh * cols,)](part, *_slots(ws), *_slots(wn), *wargs, h, d, bh, chunks, cols, c, GATED=gated,
                                    BLOCK_D=bd, BLOCK_C=bc, num_warps=4)
    out = _heads_merged(b, h, n, d, q)
    bn, _, warps = launch_cfg(bd, "apply", q.dtype == torch.float32)
    n_tiles = triton.cdiv(n, bn)
    mixed = out if mix is None else mix  # never read without HAS_MIX
    _fwd_apply[(bh * n_tiles,)](q, *_slots(wn), out, mixed, *q.stride(), *out.stride(), *mixed.stride(), h, n, d, bh,
                                n_tiles, float(mix_weight), GATED=gated, BLOCK_N=bn, BLOCK_D=bd, PREC=prec,
                                HAS_MIX=mix is not None, num_warps=warps)
    return out, wn


def inner_bwd_triton(do, q, k, v, ws: Sequence[torch.Tensor], wn: Sequence[torch.Tensor], scale: float,
                     gated: bool, mix_weight: Optional[float] = None, dqk: Optional[torch.Tensor] = None):
    """Triton backward in 3 launches (4 under ``torch.use_deterministic_algorithms``: dW summed in a fixed order
    instead of by relaxed atomic adds): [dq, dk, dv, dW...] (dW in fp32, cast to the weights' dtype if lower);
    recomputes every N x d intermediate from q, k, v, W and W' (fp32 contiguous (B, heads, d, d), as saved).
    ``mix_weight`` (the forward blended with ``mix``): dO is scaled by (1 - mix_weight) in ``_bwd_apply``, which
    also writes d mix = mix_weight dO, returned last.  ``dqk`` (2, B, heads, N, d): dq and dk are written into its
    two halves (returned as views of it)."""
    op = _op_name(gated)
    b, h, n, d, bd, bn, tiles, warps, chunks = _sizes(q, op, "bwd")
    n_w, bh, prec, dev, f32 = len(ws), b * h, dot_prec(q.dtype), q.device, torch.float32
    c = (-scale if gated else scale) / n
    n_wb = ws[0].shape[0]
    if any(w.shape[0] != n_wb for w in ws):
        raise ValueError(f"{op}: the inner weights must all be shared (1, ...) or all per sample (B, ...), got "
                         f"{[tuple(w.shape) for w in ws]}")
    det = torch.are_deterministic_algorithms_enabled()
    single = chunks == 1  # _bwd_apply does the finalize's work: 2 launches (3 deterministic)
    part = torch.empty(n_w, bh, chunks, d, d, device=dev, dtype=f32)
    dw = [torch.empty(n_wb, h, d, d, device=dev, dtype=f32) for _ in ws]
    ct = torch.empty(n_w, b, h, d, d, device=dev, dtype=f32)
    sp = torch.empty(n_w, b, h, d, d, device=dev, dtype=f32) if det or single else ct  # each sample's dW'
    dq = _heads_merged(b, h, n, d, q) if dqk is None else dqk[0]
    dmix = dq if mix_weight is None else _heads_merged(b, h, n, d, q)  # never written without HAS_MIX
    fp32 = q.dtype == torch.float32
    stages, split = bwd_tuning("_bwd_apply", bd, fp32)
    _bwd_apply[(bh * chunks,)](q, do, *_slots(wn), dq, part, *_slots(dw), ct, sp, dmix, *q.stride(), *do.stride(),
                               *dq.stride(), *dmix.stride(), h, n, d, bh, chunks, n_wb, c, float(mix_weight or 0.0),
                               GATED=gated, TILES=tiles, BLOCK_N=bn, BLOCK_D=bd, PREC=prec,
                               HAS_MIX=mix_weight is not None, SPLIT=split, num_warps=warps, num_stages=stages)
    bc = min(BLOCK_C, bd)
    cols = triton.cdiv(d, bc)
    if not single:
        _bwd_finalize[(bh * cols,)](part, ct, *_slots(dw), sp, h, d, bh, chunks, cols, n_wb, c, GATED=gated,
                                    BLOCK_D=bd, BLOCK_C=bc, DETERMINISTIC=det, num_warps=4)
    dk, dv = _heads_merged(b, h, n, d, q) if dqk is None else dqk[1], _heads_merged(b, h, n, d, q)
    stages, split = bwd_tuning("_bwd_update", bd, fp32)
    _bwd_update[(bh * chunks,)](k, v, *_slots(ws), ct, dk, dv, *_slots(dw), part, sp, *k.stride(), *v.stride(),
                                *_wargs(ws), *dk.stride(), *dv.stride(), h, n, d, bh, chunks, n_wb, GATED=gated,
                                TILES=tiles, BLOCK_N=bn, BLOCK_D=bd, PREC=prec, DETERMINISTIC=det,
                                SPLIT=split, num_warps=warps, num_stages=stages)
    if det:  # a fourth launch sums the partials in a fixed order (bitwise reproducible)
        _bwd_reduce[(n_wb * h * cols,)](part, sp, *_slots(dw), h, d, bh, chunks, cols, b // n_wb, GATED=gated,
                                        BLOCK_D=bd, BLOCK_C=bc, num_warps=4)
    grads = [dq, dk, dv] + [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(dw, ws)]
    return grads if mix_weight is None else grads + [dmix]


t5_fwd_triton, t5_bwd_triton, dit5_fwd_triton, dit5_bwd_triton = model_entry_points(inner_fwd_triton,
                                                                                     inner_bwd_triton)


# differentiable entry points straight over the kernels, without the custom op (the kernel tests use them)
T5TTTTriton = make_function("T5TTTTriton", t5_fwd_triton, t5_bwd_triton, 3)
DiT5TTTTriton = make_function("DiT5TTTTriton", dit5_fwd_triton, dit5_bwd_triton, 2)


def t5_swiglu_ttt_triton(q, k, v, w1, w2, w3, scale: float) -> torch.Tensor:
    return T5TTTTriton.apply(q, k, v, w1, w2, w3, float(scale))


def mlp_ttt_triton(q, k, v, w1, w2, scale: float) -> torch.Tensor:
    return DiT5TTTTriton.apply(q, k, v, w1, w2, float(scale))
