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
           "qk_norm_fold_bwd_triton"]

BLOCK_N = 64
BLOCK_C = 32


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


KeyNormTriton = make_function("KeyNormTriton", key_norm_fwd_triton, key_norm_bwd_triton)


def key_norm_triton(x: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    return KeyNormTriton.apply(x, float(eps))
