"""Triton kernels of the key instance-norm (see ``naive.py`` for the math), forward and backward.

One program per (sample, block of BLOCK_C channels) loops over the N tokens in BLOCK_N tiles; x may be any strided
(B, N, C) view (e.g. the k slice of the qkv output); loads are upcast to float32 and statistics accumulate in fp32.
  fwd ``_knorm_fwd``: pass 1 sum -> mean, pass 2 sum of squared deviations -> rstd (two-pass, no cancellation),
      pass 3 writes y = (x - mean) rstd and the (B, C) fp32 mean / rstd.
  bwd ``_knorm_bwd``: pass 1 reduces sum(dy) and sum(dy x^) (x^ recomputed from x, mean, rstd), pass 2 writes
      dx = rstd (dy - mean(dy) - x^ mean(dy x^)).
Memory per (sample, channel): 2 fp32 saved (mean, rstd); nothing else beyond y / dx themselves.
``CAT`` (the T5 / DiT5 q and k convs as one depthwise conv over 2C channels, ``qk_norm_fold_fwd_triton``): the same
launch writes [q | y] into one (B, N, 2C) buffer (pass 3 copies the q tile) and, in the first sample's programs,
the two convs' taps with the identity folded in (the residual ``z + conv(z)``) and their biases, stacked.
``COPY`` (T5+: its neighbourhood attention reads q and k too): pass 3 also writes copies of q and k, so that the
attention's gradients come back to this op's backward, whose ``_knorm_bwd`` adds them to dq and dk as it stores
them (``ADD``) instead of autograd adding them after.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import jit_sizes, pid64
from .torch import check_key_norm, check_qk_norm_fold, make_function

__all__ = ["key_norm_fwd_triton", "key_norm_bwd_triton", "key_norm_triton", "qk_norm_fold_fwd_triton",
           "qk_norm_fold_bwd_triton", "qkv_fold_fwd_triton", "qkv_fold_bwd_triton"]

BLOCK_N = 64
BLOCK_C = 32
# the DiT5 qkv kernels hold the conv taps' shifted tiles: 64-token tiles on 4 warps spilled 140-948 bytes on sm_90
# (255 registers), on 8 warps 24-32 bytes in the backward: 8 warps, and 32-token tiles in the backward (the
# forward's bf16 then spilled 4 bytes at 128 registers): none (experiments/compile_kernels.py)
DIT5_WARPS = 8
DIT5_BWD_TOKENS = 32


@triton.jit
def _load_cols(ptr, base, offs_n, offs_c, sn, sc, N, C):
    m = (offs_n[:, None] < N) & (offs_c[None, :] < C)
    return tl.load(ptr + base + offs_n[:, None] * sn + offs_c[None, :] * sc, mask=m, other=0.0).to(tl.float32), m


@triton.jit
def _fold_taps(W, B, WF, BF, row0, offs_c, offs_t, C, n_taps):
    """Rows ``row0 + offs_c`` of the stacked (2C, n_taps) taps = W + identity (1 at the centre tap), and of the biases."""
    cm = offs_c < C
    m = cm[:, None] & (offs_t[None, :] < n_taps)
    eye = (offs_t[None, :] == n_taps // 2).to(tl.float32)
    w = tl.load(W + offs_c[:, None] * n_taps + offs_t[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(WF + (row0 + offs_c[:, None]) * n_taps + offs_t[None, :], (w + eye).to(WF.dtype.element_ty), mask=m)
    tl.store(BF + row0 + offs_c, tl.load(B + offs_c, mask=cm, other=0.0), mask=cm)


@jit_sizes(also=("sxb", "syb", "sqb", "scb"))
def _knorm_fwd(X, Y, MEAN, RSTD, Q, YQ, WQ, BQ, WK, BK, WF, BF, QC, KC, sxb, sxn, sxc, syb, syn, syc, sqb, sqn, sqc,
               scb, scn, scc, N, C, n_taps, eps, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
               CAT: tl.constexpr, COPY: tl.constexpr):
    b, cb = pid64(0), pid64(1)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        x, m = _load_cols(X, b * sxb, start + tl.arange(0, BLOCK_N), offs_c, sxn, sxc, N, C)
        acc += tl.sum(x, axis=0)
    mean = acc / N
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        x, m = _load_cols(X, b * sxb, start + tl.arange(0, BLOCK_N), offs_c, sxn, sxc, N, C)
        dev = tl.where(m, x - mean[None, :], 0.0)
        acc += tl.sum(dev * dev, axis=0)
    rstd = 1.0 / tl.sqrt(acc / N + eps)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        x, m = _load_cols(X, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        y = (x - mean[None, :]) * rstd[None, :]
        tl.store(Y + b * syb + offs_n[:, None] * syn + offs_c[None, :] * syc, y.to(Y.dtype.element_ty), mask=m)
        if CAT:  # the q half of [q | y]
            q = tl.load(Q + b * sqb + offs_n[:, None] * sqn + offs_c[None, :] * sqc, mask=m, other=0.0)
            tl.store(YQ + b * syb + offs_n[:, None] * syn + offs_c[None, :] * syc, q.to(YQ.dtype.element_ty), mask=m)
            if COPY:  # q and k for the neighbourhood attention
                at = b * scb + offs_n[:, None] * scn + offs_c[None, :] * scc
                tl.store(QC + at, q, mask=m)
                tl.store(KC + at, x.to(KC.dtype.element_ty), mask=m)
    if CAT:
        if b == 0:  # the folded taps and biases, once
            offs_t = tl.arange(0, BLOCK_T)
            _fold_taps(WQ, BQ, WF, BF, 0, offs_c, offs_t, C, n_taps)
            _fold_taps(WK, BK, WF, BF, C, offs_c, offs_t, C, n_taps)
    cm = offs_c < C
    tl.store(MEAN + b * C + offs_c, mean, mask=cm)
    tl.store(RSTD + b * C + offs_c, rstd, mask=cm)


@jit_sizes(also=("sab",))
def _knorm_bwd(DY, X, MEAN, RSTD, DX, DYQ, DQA, DKA, DQ, sdb, sdn, sdc, sxb, sxn, sxc, sgb, sgn, sgc,
               sqb, sqn, sqc, sab, san, sac, N, C, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ADD: tl.constexpr):
    """dx = the key norm's backward of dy; ``ADD``: + DKA, and DQ = DYQ + DQA (``DQA``, ``DKA``: one layout, ``sa*``;
    DQ has DX's strides)."""
    b, cb = pid64(0), pid64(1)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    mean = tl.load(MEAN + b * C + offs_c, mask=cm, other=0.0)
    rstd = tl.load(RSTD + b * C + offs_c, mask=cm, other=0.0)
    s1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        dy, m = _load_cols(DY, b * sdb, offs_n, offs_c, sdn, sdc, N, C)
        x, m = _load_cols(X, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        xh = tl.where(m, (x - mean[None, :]) * rstd[None, :], 0.0)
        s1 += tl.sum(dy, axis=0)
        s2 += tl.sum(dy * xh, axis=0)
    m1, m2 = s1 / N, s2 / N
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        dy, m = _load_cols(DY, b * sdb, offs_n, offs_c, sdn, sdc, N, C)
        x, m = _load_cols(X, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        xh = (x - mean[None, :]) * rstd[None, :]
        dx = rstd[None, :] * (dy - m1[None, :] - xh * m2[None, :])
        at = b * sgb + offs_n[:, None] * sgn + offs_c[None, :] * sgc
        if ADD:
            dka, m = _load_cols(DKA, b * sab, offs_n, offs_c, san, sac, N, C)
            dx += dka
            dq, m = _load_cols(DYQ, b * sqb, offs_n, offs_c, sqn, sqc, N, C)
            dqa, m = _load_cols(DQA, b * sab, offs_n, offs_c, san, sac, N, C)
            tl.store(DQ + at, (dq + dqa).to(DQ.dtype.element_ty), mask=m)
        tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=m)


def key_norm_fwd_triton(x: torch.Tensor, eps: float):
    """(y (B, N, C) in x's dtype, mean (B, C) fp32, rstd (B, C) fp32)."""
    check_key_norm(x, eps)
    b, n, c = x.shape
    y = torch.empty(b, n, c, device=x.device, dtype=x.dtype)
    mean = torch.empty(b, c, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _knorm_fwd[(b, triton.cdiv(c, BLOCK_C))](x, y, mean, rstd, x, y, x, x, x, x, y, y, y, y, *x.stride(),
                                            *y.stride(), *x.stride(), *y.stride(), n, c, 1, float(eps),
                                            BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, BLOCK_T=1, CAT=False, COPY=False)
    return y, mean, rstd


def qk_norm_fold_fwd_triton(q, k, eps: float, wq, bq, wk, bk, copy_qk: bool = False):
    """One launch: ([q | key_norm(k)] (B, N, 2C) in k's dtype, the stacked taps (2C, 1, kh, kw) with the identity
    folded in, the stacked biases (2C,), mean, rstd (B, C) fp32 of k, and with ``copy_qk`` copies of q and k
    (B, N, C))."""
    check_qk_norm_fold(q, k, eps, wq, bq, wk, bk)
    b, n, c = k.shape
    y = torch.empty(b, n, 2 * c, device=k.device, dtype=k.dtype)
    wf = torch.empty((2 * c,) + tuple(wq.shape[1:]), device=wq.device, dtype=wq.dtype)
    bf = torch.empty(2 * c, device=bq.device, dtype=bq.dtype)
    mean = torch.empty(b, c, device=k.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    taps = wq[0].numel()
    wq, bq, wk, bk = (t.contiguous() for t in (wq, bq, wk, bk))
    qc, kc = (torch.empty_like(k, memory_format=torch.contiguous_format) if copy_qk else y for _ in range(2))
    _knorm_fwd[(b, triton.cdiv(c, BLOCK_C))](k, y[..., c:], mean, rstd, q, y[..., :c], wq, bq, wk, bk, wf, bf, qc,
                                            kc, *k.stride(), *y.stride(), *q.stride(), *qc.stride(), n, c, taps,
                                            float(eps), BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
                                            BLOCK_T=triton.next_power_of_2(taps), CAT=True, COPY=copy_qk)
    return (y, wf, bf, mean, rstd) + ((qc, kc) if copy_qk else ())


def key_norm_bwd_triton(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    b, n, c = x.shape
    dx = torch.empty(b, n, c, device=x.device, dtype=x.dtype)
    _knorm_bwd[(b, triton.cdiv(c, BLOCK_C))](dy, x, mean.float().contiguous(), rstd.float().contiguous(), dx, dy, dy,
                                            dy, dx, *dy.stride(), *x.stride(), *dx.stride(), *dy.stride(),
                                            *dy.stride(), n, c, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, ADD=False)
    return dx


def qk_norm_fold_bwd_triton(dy: torch.Tensor, k: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                            dqa: torch.Tensor, dka: torch.Tensor):
    """(dq, dk) of ``qk_norm_fold_fwd_triton`` with ``copy_qk`` in one launch: dy (B, N, 2C) the gradient of
    [q | key norm(k)], dqa, dka (B, N, C, one layout) those of the copies: dq = dy[..., :C] + dqa, dk = the key
    norm's backward of dy[..., C:] + dka."""
    b, n, c = k.shape
    if dqa.stride() != dka.stride():
        dqa, dka = dqa.contiguous(), dka.contiguous()
    dq, dk = (torch.empty(b, n, c, device=k.device, dtype=k.dtype) for _ in range(2))
    dyq, dyk = dy[..., :c], dy[..., c:]
    _knorm_bwd[(b, triton.cdiv(c, BLOCK_C))](dyk, k, mean.float().contiguous(), rstd.float().contiguous(), dk, dyq,
                                            dqa, dka, dq, *dyk.stride(), *k.stride(), *dk.stride(), *dyq.stride(),
                                            *dqa.stride(), n, c, BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, ADD=True)
    return dq, dk


# --------------------------------------------------------------------------------------------------------- DiT5
# ``qkv_fold_fwd_triton`` / ``qkv_fold_bwd_triton``: DiT5's whole TTT input path from the qkv output in one launch
# each way.  One program per (sample, block of BLOCK_C channels), tokens in BLOCK_N tiles of the row-major map:
#   fwd ``_dit5_fwd``: passes 1-2 the statistics of k' = k s_k + o_k (as ``_knorm_fwd``); pass 3 per tile the two
#       residual depthwise convs q2 = q' + conv_q(q') + b_q, k2 = kn + conv_k(kn) + b_k (q' = q s_q + o_q,
#       kn = (k' - mean) rstd, zero outside the map), each tap a shifted masked load of the raw qkv, written as
#       [q2 | k2] (B, N, 2C); copies of q, k, v, v (the neighbourhood attention's q, k, v, the inner step's v).
#   bwd ``_dit5_bwd``: g = d[q2 | k2]; dz = g + conv^T(g) per half (the taps mirrored); pass 1 the key norm's sums
#       over the tokens, pass 2 writes the whole d qkv = [dq' s_q + dqc | dkn's norm backward s_k + dkc | dvc + dvt]
#       and this program's partial sums (over its tokens) of every parameter's gradient, one row of P (B, R):
#       [scale (C, 2) | offset (C, 2) | w_q (C, taps) | b_q | w_k (C, taps) | b_k], reduced over the batch after by
#       one sum in a fixed order (no atomics).


@triton.jit
def _tap_tile(PTR, base, offs_n, hh, ww, dh, dw, offs_c, cm, sn, sc, N, Hh, Ww):
    """The tile at the token offset (dh, dw) of each row's map position, fp32, and its mask (0 off the map)."""
    hs = hh + dh
    ws = ww + dw
    valid = (offs_n < N) & (hs >= 0) & (hs < Hh) & (ws >= 0) & (ws < Ww)
    m = valid[:, None] & cm[None, :]
    src = offs_n + dh * Ww + dw
    return tl.load(PTR + base + src[:, None] * sn + offs_c[None, :] * sc, mask=m, other=0.0).to(tl.float32), m


@triton.jit
def _conv_t(G, base, offs_n, hh, ww, offs_c, cm, sn, sc, W, N, Hh, Ww, KH: tl.constexpr, KW: tl.constexpr):
    """g + conv^T(g) at the tile's rows: the gradient of z + conv(z) for the output gradient g (depthwise taps W,
    (C, KH * KW) contiguous): sum over taps t of W_t g at the output position that read this row through t."""
    g, m = _tap_tile(G, base, offs_n, hh, ww, 0, 0, offs_c, cm, sn, sc, N, Hh, Ww)
    acc = g
    for i in tl.static_range(KH):
        for j in tl.static_range(KW):
            gs, ms = _tap_tile(G, base, offs_n, hh, ww, KH // 2 - i, KW // 2 - j, offs_c, cm, sn, sc, N, Hh, Ww)
            w = tl.load(W + offs_c * (KH * KW) + i * KW + j, mask=cm, other=0.0).to(tl.float32)
            acc += gs * w[None, :]
    return acc, g, m


@jit_sizes(also=("sxb", "syb", "scb"))
def _dit5_fwd(QKV, S, O, WQ, BQ, WK, BK, Y, MEAN, RSTD, QC, KC, VC, VT, sxb, sxn, sxc, syb, syn, syc, scb, scn, scc,
              N, Hh, Ww, C, eps, KH: tl.constexpr, KW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    b, cb = pid64(0), pid64(1)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    K = QKV + C * sxc
    sq = tl.load(S + offs_c * 2, mask=cm, other=0.0).to(tl.float32)
    oq = tl.load(O + offs_c * 2, mask=cm, other=0.0).to(tl.float32)
    sk = tl.load(S + offs_c * 2 + 1, mask=cm, other=0.0).to(tl.float32)
    ok = tl.load(O + offs_c * 2 + 1, mask=cm, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        x, m = _load_cols(K, b * sxb, start + tl.arange(0, BLOCK_N), offs_c, sxn, sxc, N, C)
        acc += tl.sum(tl.where(m, x * sk[None, :] + ok[None, :], 0.0), axis=0)
    mean = acc / N
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        x, m = _load_cols(K, b * sxb, start + tl.arange(0, BLOCK_N), offs_c, sxn, sxc, N, C)
        dev = tl.where(m, x * sk[None, :] + ok[None, :] - mean[None, :], 0.0)
        acc += tl.sum(dev * dev, axis=0)
    rstd = 1.0 / tl.sqrt(acc / N + eps)
    bq = tl.load(BQ + offs_c, mask=cm, other=0.0).to(tl.float32)
    bk = tl.load(BK + offs_c, mask=cm, other=0.0).to(tl.float32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        hh = offs_n // Ww
        ww = offs_n % Ww
        xq, m = _tap_tile(QKV, b * sxb, offs_n, hh, ww, 0, 0, offs_c, cm, sxn, sxc, N, Hh, Ww)
        xk, m = _tap_tile(K, b * sxb, offs_n, hh, ww, 0, 0, offs_c, cm, sxn, sxc, N, Hh, Ww)
        accq = xq * sq[None, :] + oq[None, :] + bq[None, :]  # the residual and the bias
        acck = (xk * sk[None, :] + ok[None, :] - mean[None, :]) * rstd[None, :] + bk[None, :]
        for i in tl.static_range(KH):
            for j in tl.static_range(KW):
                zq, ms = _tap_tile(QKV, b * sxb, offs_n, hh, ww, i - KH // 2, j - KW // 2, offs_c, cm, sxn, sxc, N,
                                   Hh, Ww)
                zk, ms = _tap_tile(K, b * sxb, offs_n, hh, ww, i - KH // 2, j - KW // 2, offs_c, cm, sxn, sxc, N,
                                   Hh, Ww)
                zq = tl.where(ms, zq * sq[None, :] + oq[None, :], 0.0)
                zk = tl.where(ms, (zk * sk[None, :] + ok[None, :] - mean[None, :]) * rstd[None, :], 0.0)
                wq = tl.load(WQ + offs_c * (KH * KW) + i * KW + j, mask=cm, other=0.0).to(tl.float32)
                wk = tl.load(WK + offs_c * (KH * KW) + i * KW + j, mask=cm, other=0.0).to(tl.float32)
                accq += zq * wq[None, :]
                acck += zk * wk[None, :]
        at_y = Y + b * syb + offs_n[:, None] * syn + offs_c[None, :] * syc
        tl.store(at_y, accq.to(Y.dtype.element_ty), mask=m)
        tl.store(at_y + C * syc, acck.to(Y.dtype.element_ty), mask=m)
        at = b * scb + offs_n[:, None] * scn + offs_c[None, :] * scc  # the raw q, k, v, v
        tl.store(QC + at, xq.to(QC.dtype.element_ty), mask=m)
        tl.store(KC + at, xk.to(KC.dtype.element_ty), mask=m)
        v, m = _tap_tile(QKV + 2 * C * sxc, b * sxb, offs_n, hh, ww, 0, 0, offs_c, cm, sxn, sxc, N, Hh, Ww)
        tl.store(VC + at, v.to(VC.dtype.element_ty), mask=m)
        tl.store(VT + at, v.to(VT.dtype.element_ty), mask=m)
    tl.store(MEAN + b * C + offs_c, mean, mask=cm)
    tl.store(RSTD + b * C + offs_c, rstd, mask=cm)


@triton.jit
def _tap_sums(acc, G, Z, base_g, base_z, offs_n, hh, ww, offs_c, cm, sgn, sgc, szn, szc, s, o, mean, rstd, N, Hh, Ww,
              NORM: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, BLOCK_T: tl.constexpr):
    """acc (BLOCK_T, BLOCK_C) += per tap t, sum over the tile's rows of g * z at the row's position shifted by t:
    the taps' gradient; z = x s + o (q'), with ``NORM`` normalised (kn), recomputed from the raw x."""
    g, m = _tap_tile(G, base_g, offs_n, hh, ww, 0, 0, offs_c, cm, sgn, sgc, N, Hh, Ww)
    offs_t = tl.arange(0, BLOCK_T)
    for i in tl.static_range(KH):
        for j in tl.static_range(KW):
            z, ms = _tap_tile(Z, base_z, offs_n, hh, ww, i - KH // 2, j - KW // 2, offs_c, cm, szn, szc, N, Hh, Ww)
            z = z * s[None, :] + o[None, :]
            if NORM:
                z = (z - mean[None, :]) * rstd[None, :]
            part = tl.sum(tl.where(ms, g * z, 0.0), axis=0)
            acc += tl.where(offs_t[:, None] == i * KW + j, part[None, :], 0.0)
    return acc


# s2n, s2c: dkc, the attention's gradient of its k copy, comes channel-major at some map sizes and token-major
# at others (either stride is 1): neither is specialised, one compiled variant for every size
@jit_sizes(also=("sdb", "sxb", "sgb", "s1b", "s2b", "s3b", "s4b", "s2n", "s2c"))
def _dit5_bwd(DY, QKV, MEAN, RSTD, S, O, WQ, WK, DQC, DKC, DVC, DVT, DQKV, P, sdb, sdn, sdc, sxb, sxn, sxc, sgb, sgn,
              sgc, s1b, s1n, s1c, s2b, s2n, s2c, s3b, s3n, s3c, s4b, s4n, s4c, N, Hh, Ww, C, R, KH: tl.constexpr,
              KW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    b, cb = pid64(0), pid64(1)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    K = QKV + C * sxc
    DYK = DY + C * sdc
    mean = tl.load(MEAN + b * C + offs_c, mask=cm, other=0.0)
    rstd = tl.load(RSTD + b * C + offs_c, mask=cm, other=0.0)
    sq = tl.load(S + offs_c * 2, mask=cm, other=0.0).to(tl.float32)
    oq = tl.load(O + offs_c * 2, mask=cm, other=0.0).to(tl.float32)
    sk = tl.load(S + offs_c * 2 + 1, mask=cm, other=0.0).to(tl.float32)
    ok = tl.load(O + offs_c * 2 + 1, mask=cm, other=0.0).to(tl.float32)
    s1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        hh = offs_n // Ww
        ww = offs_n % Ww
        dkn, gk, m = _conv_t(DYK, b * sdb, offs_n, hh, ww, offs_c, cm, sdn, sdc, WK, N, Hh, Ww, KH, KW)
        x, m = _load_cols(K, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        xh = tl.where(m, (x * sk[None, :] + ok[None, :] - mean[None, :]) * rstd[None, :], 0.0)
        s1 += tl.sum(tl.where(m, dkn, 0.0), axis=0)
        s2 += tl.sum(dkn * xh, axis=0)
    m1, m2 = s1 / N, s2 / N
    g_sq = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_oq = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_sk = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_ok = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_bq = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_bk = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_wq = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    g_wk = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        hh = offs_n // Ww
        ww = offs_n % Ww
        dkn, gk, m = _conv_t(DYK, b * sdb, offs_n, hh, ww, offs_c, cm, sdn, sdc, WK, N, Hh, Ww, KH, KW)
        dqa, gq, m = _conv_t(DY, b * sdb, offs_n, hh, ww, offs_c, cm, sdn, sdc, WQ, N, Hh, Ww, KH, KW)
        xk, m = _load_cols(K, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        xq, m = _load_cols(QKV, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        xh = (xk * sk[None, :] + ok[None, :] - mean[None, :]) * rstd[None, :]
        dka = tl.where(m, rstd[None, :] * (dkn - m1[None, :] - xh * m2[None, :]), 0.0)  # d of k' (the affine's k)
        dqa = tl.where(m, dqa, 0.0)
        g_sq += tl.sum(dqa * xq, axis=0)
        g_oq += tl.sum(dqa, axis=0)
        g_sk += tl.sum(dka * xk, axis=0)
        g_ok += tl.sum(dka, axis=0)
        g_bq += tl.sum(gq, axis=0)
        g_bk += tl.sum(gk, axis=0)
        g_wq = _tap_sums(g_wq, DY, QKV, b * sdb, b * sxb, offs_n, hh, ww, offs_c, cm, sdn, sdc, sxn, sxc, sq, oq, mean,
                         rstd, N, Hh, Ww, False, KH, KW, BLOCK_T)
        g_wk = _tap_sums(g_wk, DYK, K, b * sdb, b * sxb, offs_n, hh, ww, offs_c, cm, sdn, sdc, sxn, sxc, sk, ok, mean,
                         rstd, N, Hh, Ww, True, KH, KW, BLOCK_T)
        dqc, m = _load_cols(DQC, b * s1b, offs_n, offs_c, s1n, s1c, N, C)
        dkc, m = _load_cols(DKC, b * s2b, offs_n, offs_c, s2n, s2c, N, C)
        dvc, m = _load_cols(DVC, b * s3b, offs_n, offs_c, s3n, s3c, N, C)
        dvt, m = _load_cols(DVT, b * s4b, offs_n, offs_c, s4n, s4c, N, C)
        at = DQKV + b * sgb + offs_n[:, None] * sgn + offs_c[None, :] * sgc
        tl.store(at, (dqa * sq[None, :] + dqc).to(DQKV.dtype.element_ty), mask=m)
        tl.store(at + C * sgc, (dka * sk[None, :] + dkc).to(DQKV.dtype.element_ty), mask=m)
        tl.store(at + 2 * C * sgc, (dvc + dvt).to(DQKV.dtype.element_ty), mask=m)
    T = KH * KW
    row = P + b * R
    tl.store(row + offs_c * 2, g_sq, mask=cm)
    tl.store(row + offs_c * 2 + 1, g_sk, mask=cm)
    tl.store(row + 2 * C + offs_c * 2, g_oq, mask=cm)
    tl.store(row + 2 * C + offs_c * 2 + 1, g_ok, mask=cm)
    offs_t = tl.arange(0, BLOCK_T)
    mt = (offs_t[:, None] < T) & cm[None, :]
    tl.store(row + 4 * C + offs_c[None, :] * T + offs_t[:, None], g_wq, mask=mt)
    tl.store(row + 4 * C + C * T + offs_c, g_bq, mask=cm)
    tl.store(row + 5 * C + C * T + offs_c[None, :] * T + offs_t[:, None], g_wk, mask=mt)
    tl.store(row + 5 * C + 2 * C * T + offs_c, g_bk, mask=cm)


def qkv_fold_fwd_triton(qkv, eps: float, scale, offset, wq, bq, wk, bk, h: int, w: int):
    """DiT5's one launch on the qkv output (B, N, 3C), N = h * w row-major: ([q2 | k2] (B, N, 2C), mean, rstd of k'
    (B, C) fp32, copies of q, k, v, v (B, N, C)); q2 = q' + conv_q(q') + b_q, k2 = kn + conv_k(kn) + b_k,
    q' = q s_q + o_q, kn = key_norm(k s_k + o_k) (``scale``, ``offset`` (1, 1, C, 2), [..., 0] for q)."""
    b, n, c3 = qkv.shape
    c = c3 // 3
    y = torch.empty(b, n, 2 * c, device=qkv.device, dtype=qkv.dtype)
    mean = torch.empty(b, c, device=qkv.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    qc, kc, vc, vt = (torch.empty(b, n, c, device=qkv.device, dtype=qkv.dtype) for _ in range(4))
    scale, offset, wq, bq, wk, bk = (t.contiguous() for t in (scale, offset, wq, bq, wk, bk))
    _dit5_fwd[(b, triton.cdiv(c, BLOCK_C))](qkv, scale, offset, wq, bq, wk, bk, y, mean, rstd, qc, kc, vc, vt,
                                           *qkv.stride(), *y.stride(), *qc.stride(), n, h, w, c, float(eps),
                                           KH=wq.shape[2], KW=wq.shape[3], BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
                                           num_warps=DIT5_WARPS)
    return y, mean, rstd, qc, kc, vc, vt


def qkv_fold_bwd_triton(dy, qkv, mean, rstd, scale, offset, wq, wk, h: int, w: int, dqc, dkc, dvc, dvt):
    """(d qkv (B, N, 3C), the per-program partial sums P (B, R) fp32 of the parameters' gradients, laid out
    [scale | offset | w_q | b_q | w_k | b_k] each in its parameter's layout) of ``qkv_fold_fwd_triton``, one launch;
    dy: the gradient of [q2 | k2], dqc .. dvt those of the copies (any layouts)."""
    b, n, c3 = qkv.shape
    c = c3 // 3
    taps = wq.shape[2] * wq.shape[3]
    r = 6 * c + 2 * c * taps
    dqkv = torch.empty(b, n, c3, device=qkv.device, dtype=qkv.dtype)
    partial = torch.empty(b, r, device=qkv.device, dtype=torch.float32)
    scale, offset, wq, wk = (t.contiguous() for t in (scale, offset, wq, wk))
    _dit5_bwd[(b, triton.cdiv(c, BLOCK_C))](dy, qkv, mean.float().contiguous(), rstd.float().contiguous(), scale,
                                           offset, wq, wk, dqc, dkc, dvc, dvt, dqkv, partial, *dy.stride(),
                                           *qkv.stride(), *dqkv.stride(), *dqc.stride(), *dkc.stride(),
                                           *dvc.stride(), *dvt.stride(), n, h, w, c, r, KH=wq.shape[2],
                                           KW=wq.shape[3], BLOCK_N=min(BLOCK_N, DIT5_BWD_TOKENS), BLOCK_C=BLOCK_C,
                                           BLOCK_T=triton.next_power_of_2(taps), num_warps=DIT5_WARPS)
    return dqkv, partial


KeyNormTriton = make_function("KeyNormTriton", key_norm_fwd_triton, key_norm_bwd_triton)


def key_norm_triton(x: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    return KeyNormTriton.apply(x, float(eps))
