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
def _knorm_fwd(X, Y, MEAN, RSTD, Q, YQ, WQ, BQ, WK, BK, WF, BF, QC, KC, V, VC, VT, S, O, sxb, sxn, sxc, syb, syn,
               syc, sqb, sqn, sqc, scb, scn, scc, N, C, n_taps, eps, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
               BLOCK_T: tl.constexpr, CAT: tl.constexpr, COPY: tl.constexpr, AFFINE: tl.constexpr):
    """``AFFINE`` (DiT5): q and k first go through the per-channel affine ``S``, ``O`` ((C, 2) interleaved, [:, 0]
    for q), in fp32; with ``COPY`` the copies are of the raw q, k and also of v (``V``, q's strides) twice."""
    b, cb = pid64(0), pid64(1)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    if AFFINE:
        sq = tl.load(S + offs_c * 2, mask=cm, other=1.0).to(tl.float32)
        oq = tl.load(O + offs_c * 2, mask=cm, other=0.0).to(tl.float32)
        sk = tl.load(S + offs_c * 2 + 1, mask=cm, other=1.0).to(tl.float32)
        ok = tl.load(O + offs_c * 2 + 1, mask=cm, other=0.0).to(tl.float32)
    else:
        sq = tl.full((BLOCK_C,), 1.0, tl.float32)
        sk = tl.full((BLOCK_C,), 1.0, tl.float32)
        oq = tl.zeros((BLOCK_C,), dtype=tl.float32)
        ok = tl.zeros((BLOCK_C,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        x, m = _load_cols(X, b * sxb, start + tl.arange(0, BLOCK_N), offs_c, sxn, sxc, N, C)
        if AFFINE:
            x = tl.where(m, x * sk[None, :] + ok[None, :], 0.0)
        acc += tl.sum(x, axis=0)
    mean = acc / N
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        x, m = _load_cols(X, b * sxb, start + tl.arange(0, BLOCK_N), offs_c, sxn, sxc, N, C)
        if AFFINE:
            x = x * sk[None, :] + ok[None, :]
        dev = tl.where(m, x - mean[None, :], 0.0)
        acc += tl.sum(dev * dev, axis=0)
    rstd = 1.0 / tl.sqrt(acc / N + eps)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        xr, m = _load_cols(X, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        x = xr * sk[None, :] + ok[None, :] if AFFINE else xr
        y = (x - mean[None, :]) * rstd[None, :]
        tl.store(Y + b * syb + offs_n[:, None] * syn + offs_c[None, :] * syc, y.to(Y.dtype.element_ty), mask=m)
        if CAT:  # the q half of [q | y]
            at_q = b * sqb + offs_n[:, None] * sqn + offs_c[None, :] * sqc
            q = tl.load(Q + at_q, mask=m, other=0.0)
            qa = q.to(tl.float32) * sq[None, :] + oq[None, :] if AFFINE else q
            tl.store(YQ + b * syb + offs_n[:, None] * syn + offs_c[None, :] * syc, qa.to(YQ.dtype.element_ty),
                     mask=m)
            if COPY:  # q and k (raw) for the neighbourhood attention
                at = b * scb + offs_n[:, None] * scn + offs_c[None, :] * scc
                tl.store(QC + at, q, mask=m)
                tl.store(KC + at, xr.to(KC.dtype.element_ty), mask=m)
                if AFFINE:  # v for the attention and for the inner step, one copy each (no gradient add)
                    v = tl.load(V + at_q, mask=m, other=0.0)
                    tl.store(VC + at, v, mask=m)
                    tl.store(VT + at, v, mask=m)
    if CAT:
        if b == 0:  # the folded taps and biases, once
            offs_t = tl.arange(0, BLOCK_T)
            _fold_taps(WQ, BQ, WF, BF, 0, offs_c, offs_t, C, n_taps)
            _fold_taps(WK, BK, WF, BF, C, offs_c, offs_t, C, n_taps)
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


@jit_sizes(also=("sdb", "sxb", "sgb", "s1b", "s2b", "s3b", "s4b"))
def _qkv_fold_bwd(DY, QKV, MEAN, RSTD, S, O, DQC, DKC, DVC, DVT, DQKV, P, sdb, sdn, sdc, sxb, sxn, sxc, sgb, sgn, sgc,
                  s1b, s1n, s1c, s2b, s2n, s2c, s3b, s3n, s3c, s4b, s4n, s4c, N, C, BLOCK_N: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    """The gradient of ``qkv_fold_fwd_triton``'s input (B, N, 3C): [dy_q s_q + DQC | key norm backward of dy_k, times
    s_k, + DKC | DVC + DVT], and this program's partial sums of the affine's gradients over its N tokens into
    P (B, 2, C, 2) fp32: [b, 0] the scales' (q, k), [b, 1] the offsets'."""
    b, cb = pid64(0), pid64(1)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    mean = tl.load(MEAN + b * C + offs_c, mask=cm, other=0.0)
    rstd = tl.load(RSTD + b * C + offs_c, mask=cm, other=0.0)
    sq = tl.load(S + offs_c * 2, mask=cm, other=0.0).to(tl.float32)
    sk = tl.load(S + offs_c * 2 + 1, mask=cm, other=0.0).to(tl.float32)
    ok = tl.load(O + offs_c * 2 + 1, mask=cm, other=0.0).to(tl.float32)
    s1 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        dy, m = _load_cols(DY + C * sdc, b * sdb, offs_n, offs_c, sdn, sdc, N, C)
        x, m = _load_cols(QKV + C * sxc, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        xh = tl.where(m, (x * sk[None, :] + ok[None, :] - mean[None, :]) * rstd[None, :], 0.0)
        s1 += tl.sum(dy, axis=0)
        s2 += tl.sum(dy * xh, axis=0)
    m1, m2 = s1 / N, s2 / N
    g_sq = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_oq = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_sk = tl.zeros((BLOCK_C,), dtype=tl.float32)
    g_ok = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        dyk, m = _load_cols(DY + C * sdc, b * sdb, offs_n, offs_c, sdn, sdc, N, C)
        xk, m = _load_cols(QKV + C * sxc, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        xh = (xk * sk[None, :] + ok[None, :] - mean[None, :]) * rstd[None, :]
        dka = tl.where(m, rstd[None, :] * (dyk - m1[None, :] - xh * m2[None, :]), 0.0)  # d of the affine's k
        dyq, m = _load_cols(DY, b * sdb, offs_n, offs_c, sdn, sdc, N, C)
        xq, m = _load_cols(QKV, b * sxb, offs_n, offs_c, sxn, sxc, N, C)
        g_sq += tl.sum(dyq * xq, axis=0)
        g_oq += tl.sum(dyq, axis=0)
        g_sk += tl.sum(dka * xk, axis=0)
        g_ok += tl.sum(dka, axis=0)
        dqc, m = _load_cols(DQC, b * s1b, offs_n, offs_c, s1n, s1c, N, C)
        dkc, m = _load_cols(DKC, b * s2b, offs_n, offs_c, s2n, s2c, N, C)
        dvc, m = _load_cols(DVC, b * s3b, offs_n, offs_c, s3n, s3c, N, C)
        dvt, m = _load_cols(DVT, b * s4b, offs_n, offs_c, s4n, s4c, N, C)
        at = DQKV + b * sgb + offs_n[:, None] * sgn + offs_c[None, :] * sgc
        tl.store(at, (dyq * sq[None, :] + dqc).to(DQKV.dtype.element_ty), mask=m)
        tl.store(at + C * sgc, (dka * sk[None, :] + dkc).to(DQKV.dtype.element_ty), mask=m)
        tl.store(at + 2 * C * sgc, (dvc + dvt).to(DQKV.dtype.element_ty), mask=m)
    at_p = P + b * 4 * C + offs_c * 2
    tl.store(at_p, g_sq, mask=cm)
    tl.store(at_p + 1, g_sk, mask=cm)
    tl.store(at_p + 2 * C, g_oq, mask=cm)
    tl.store(at_p + 2 * C + 1, g_ok, mask=cm)


def key_norm_fwd_triton(x: torch.Tensor, eps: float):
    """(y (B, N, C) in x's dtype, mean (B, C) fp32, rstd (B, C) fp32)."""
    check_key_norm(x, eps)
    b, n, c = x.shape
    y = torch.empty(b, n, c, device=x.device, dtype=x.dtype)
    mean = torch.empty(b, c, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _knorm_fwd[(b, triton.cdiv(c, BLOCK_C))](x, y, mean, rstd, x, y, x, x, x, x, y, y, y, y, x, y, y, x, x,
                                            *x.stride(), *y.stride(), *x.stride(), *y.stride(), n, c, 1, float(eps),
                                            BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, BLOCK_T=1, CAT=False, COPY=False,
                                            AFFINE=False)
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
                                            kc, q, qc, kc, wq, wq, *k.stride(), *y.stride(), *q.stride(),
                                            *qc.stride(), n, c, taps, float(eps), BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
                                            BLOCK_T=triton.next_power_of_2(taps), CAT=True, COPY=copy_qk,
                                            AFFINE=False)
    return (y, wf, bf, mean, rstd) + ((qc, kc) if copy_qk else ())


def qkv_fold_fwd_triton(qkv, eps: float, scale, offset, wq, bq, wk, bk):
    """DiT5's one launch on the qkv output (B, N, 3C): ([q' | key_norm(k')] (B, N, 2C) with q' = q s_q + o_q,
    k' = k s_k + o_k (``scale``, ``offset``: (1, 1, C, 2), [..., 0] for q), the stacked folded taps and biases, mean,
    rstd of k', and copies of q, k, v, v (B, N, C): for the neighbourhood attention, and v for the inner step)."""
    b, n, c3 = qkv.shape
    c = c3 // 3
    q, k, v = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]
    check_qk_norm_fold(q, k, eps, wq, bq, wk, bk)
    y = torch.empty(b, n, 2 * c, device=k.device, dtype=k.dtype)
    wf = torch.empty((2 * c,) + tuple(wq.shape[1:]), device=wq.device, dtype=wq.dtype)
    bf = torch.empty(2 * c, device=bq.device, dtype=bq.dtype)
    mean = torch.empty(b, c, device=k.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    taps = wq[0].numel()
    wq, bq, wk, bk, scale, offset = (t.contiguous() for t in (wq, bq, wk, bk, scale, offset))
    qc, kc, vc, vt = (torch.empty(b, n, c, device=k.device, dtype=k.dtype) for _ in range(4))
    _knorm_fwd[(b, triton.cdiv(c, BLOCK_C))](k, y[..., c:], mean, rstd, q, y[..., :c], wq, bq, wk, bk, wf, bf, qc,
                                            kc, v, vc, vt, scale, offset, *k.stride(), *y.stride(), *q.stride(),
                                            *qc.stride(), n, c, taps, float(eps), BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
                                            BLOCK_T=triton.next_power_of_2(taps), CAT=True, COPY=True, AFFINE=True)
    return y, wf, bf, mean, rstd, qc, kc, vc, vt


def qkv_fold_bwd_triton(dy, qkv, mean, rstd, scale, offset, dqc, dkc, dvc, dvt):
    """(d qkv (B, N, 3C), the per-program partial sums (B, 2, C, 2) fp32 of the affine's scale and offset
    gradients) of ``qkv_fold_fwd_triton``, one launch; dy: the gradient of [q' | key norm(k')], dqc .. dvt those of
    the copies (any layouts)."""
    b, n, c3 = qkv.shape
    c = c3 // 3
    dqkv = torch.empty(b, n, c3, device=qkv.device, dtype=qkv.dtype)
    partial = torch.empty(b, 2, c, 2, device=qkv.device, dtype=torch.float32)
    scale, offset = scale.contiguous(), offset.contiguous()
    _qkv_fold_bwd[(b, triton.cdiv(c, BLOCK_C))](dy, qkv, mean.float().contiguous(), rstd.float().contiguous(), scale,
                                               offset, dqc, dkc, dvc, dvt, dqkv, partial, *dy.stride(),
                                               *qkv.stride(), *dqkv.stride(), *dqc.stride(), *dkc.stride(),
                                               *dvc.stride(), *dvt.stride(), n, c, BLOCK_N=BLOCK_N,
                                               BLOCK_C=BLOCK_C)
    return dqkv, partial


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
