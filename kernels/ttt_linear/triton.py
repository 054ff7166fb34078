"""Triton kernels of the TTT-Linear mini-batch dual-form scan (Vision-TTT), forward and backward, bidirectional.

Same math and the same general contract as ``torch.py`` (which documents the formulas and the shapes).  Direction 1
reads and writes token ``N - 1 - p`` for scan position p, so both directions run in ONE launch without flipped
copies.  The d x d state W and the bias b live in registers (fp32).  Loads are upcast to float32 and every product
and reduction accumulates in float32 (``tl.dot`` in IEEE fp32 for fp32 inputs, TF32 for fp16/bf16 inputs except
in ``_bwd_outputs`` at head dims 17-32, ``_SM90_CFG``); results are stored in float32 buffers and cast to the
input dtype; the output is (B, N, H, d) memory, zeroed by pass 1 and
summed over the two directions by pass 2's relaxed atomic adds (two addends onto 0: the same in either order).  Offsets are
int64; the sizes that change per input (batch, heads, N, the mini-batch and chunk counts, broadcast strides) are
``do_not_specialize``.

The forward is chunk-parallel, in two launches.  TTT-Linear's recurrence over mini-batches is NOT linear: the inner
gradient G_i = lnl2(K_i W_i + b_i, V_i - K_i) goes through a LayerNorm of the state's own prediction, so the state
sequence itself cannot be formed in parallel (no associative scan, unlike linear attention).  Only the part that
needs it runs sequentially; given G, the outputs are a linear function of the chunk-start state:
    pass 1 ``_fwd_states``, grid (direction x batch, heads), sequential over the mini-batches: z = k W + b, G, the
        update W -= k^T (e G), b -= sum e G.  Writes G (fp32, N x d per direction: the size of the input) and the
        incoming (W; b) at every chunk start; a chunk is ck = ``torch.ckpt_every(n_mb)`` = max(4, ceil(n_mb / 32))
        mini-batches, so at most ~32 states of (d + 1) x d per sequence, and they are exactly the checkpoints the
        backward recomputes from (saved for it in training, nothing extra).
    pass 2 ``_fwd_outputs``, grid (chunks, direction x batch, heads), every chunk in parallel (as fla's chunk_fwd_o):
        from the chunk's stored (W; b) and G, per mini-batch zb = q W + b - (eta (q k^T + 1)) G, the output
        LayerNorm + residual, and the (now linear) update W -= k^T (e G) to the next mini-batch.  Its grid grows
        with the sequence up to 32 chunks (Vision-TTT-T, batch 1: 24 programs at 224 px, 192 at 1024 and 2048 px;
        ``scan_grids``, experiments/results/visionttt_scan_grid.md).
The backward, three launches, from the chunk-start states (saved by the forward) and no per-mini-batch state:
    ``_bwd_outputs``, grid (chunks, direction x batch, heads), in parallel: walks its chunk forward from the stored
        state (recomputing z, G and each incoming state) and forms what the later mini-batches do not touch: dq
        (complete), dS^T q of dk, the eta term of dlr, partial sums of dtau and of the output LayerNorm's dln_w,
        dln_b; writes z, dzb and dG_a = -A^T dzb (fp32, N x d per direction).
    ``_bwd_states``, grid (direction x batch, heads), sequential in reverse: the (dW, db) recursion, which goes
        through the inner LayerNorm gradient (not linear): per mini-batch G and its LayerNorm statistics from the
        stored z, p = k dW + db, dG = dG_a - e p, dz by the LayerNorm backward, dW += q^T dzb + k^T dz.  Three
        d x d products per mini-batch (the old one-kernel backward: two recompute passes and ~12).  Writes dz, dv,
        adds the recurrence terms of dk and dlr; dW0, db0 at the end.
    ``_bwd_keys``, grid (chunks, direction x batch, heads), in parallel: dk += dz W_i^T, the chunk's states walked
        forward from the stored one with G recomputed from z.
    ``_reduce_partials``, one launch: the partial sums (dtau, dln_w, dln_b: one row per program; dW0, db0: one per
        sequence) summed in a fixed order.  dq, dk, dv and dlr leave the passes summed over the directions (and dq + dk
        for a shared q = k): zeroed by the first pass, each direction's complete value added by a relaxed atomic
        add (two addends onto 0: deterministic).
The dot inner loss (``DOT``, ``linear_attention.naive``: G = -v, the raw prediction out) is the same scan without
the inner LayerNorm: G does not read the state, so there is no dz and no ``_bwd_keys`` (dk is complete in pass 2).
Memory per (batch, head) and direction (d = head dim, b = mini_batch, n_mb = ceil(N / b), ck as above):
    forward: the fp32 N x d output and G, ceil(n_mb / ck) <= ~32 chunk states of (d + 1) x d, also the only thing
    saved for the backward besides the inputs;
    backward: dq, dk, dv, z, dzb, dG_a, dz as fp32 N x d, (ceil(n_mb / ck) + 1) x (b + 2 d) fp32 partials.
    E.g. d = 64, b = 16, N = 16384: 32 saved states = 0.53 MB (every mini-batch: 17 MB; per-token weights: 268 MB).
In-chunk RoPE (``ROPE``, the (2, b, d / 2) cos / sin table of the in-mini-batch positions): q, k are turned on
load (the partner columns loaded too), dq and dk turned back before their last store.  The rates ``lr_scale *
sigmoid(logit)`` (``LR_SIG``) and tau ``max(0, 1 / i + offset)`` (``TAU_OFF``) are formed on load; dlr and the dtau
partials leave as d logit, d offset.  The callers then launch nothing around the scan for them.
"""
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..triton_utils import block_d as _block_d, pid64, prec as _prec
from .torch import ckpt_every

__all__ = ["scan_fwd_triton", "scan_bwd_triton", "scan_grids"]


# the strides of q, k (direction, batch, head, token), v and lr (batch, head, token): they change with the input
# size and layout, so one compiled variant serves all (the head-dim stride of q, k, v is 1)
_STRIDES_NS = ["sqr", "sqb", "sqh", "sqn", "skr", "skb", "skh", "skn", "svb", "svh", "svn", "slb", "slh", "sln"]


@triton.jit
def _ln_stats(z, dmask, D, eps):
    """(z - mean) / std over the D valid columns (padded columns 0), and 1 / std."""
    zm = tl.where(dmask[None, :], z, 0.0)
    mu = tl.sum(zm, 1) / D
    zc = tl.where(dmask[None, :], z - mu[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(zc * zc, 1) / D + eps)
    return zc * rstd[:, None], rstd


@triton.jit
def _ln_op(dx, xh, rstd, dmask, D):
    """(dx - mean(dx) - xh mean(dx xh)) / std, padded columns 0 (LayerNorm backward; symmetric)."""
    r = (dx - (tl.sum(dx, 1) / D)[:, None] - xh * (tl.sum(dx * xh, 1) / D)[:, None]) * rstd[:, None]
    return tl.where(dmask[None, :], r, 0.0)


@triton.jit
def _load_rows(ptr, t, stride_t, offs_d, m2):
    """Rows ``t`` (token stride ``stride_t``, unit column stride) as fp32."""
    return tl.load(ptr + t[:, None] * stride_t + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _at(ptr, rows, offs_d):
    """Pointers to columns ``offs_d`` of the rows that start at ``ptr + rows`` (int64 row offsets: a tile of int64
    row x column offsets held across a loop body costs twice the registers)."""
    return (ptr + rows)[:, None] + offs_d[None, :]


@triton.jit
def _partner(offs_d, D):
    """The rotate-half partner column of every column: p <-> p + D / 2."""
    half = D // 2
    return tl.where(offs_d < half, offs_d + half, offs_d - half)


@triton.jit
def _rope_table(CS, offs_c, offs_d, m2, D, MB):
    """cos and the signed sin (-sin on the first half of the columns) of in-mini-batch positions ``offs_c``."""
    half = D // 2
    o = offs_c[:, None] * half + (offs_d % half)[None, :]
    cs = tl.load(CS + o, mask=m2, other=0.0)
    sn = tl.load(CS + MB * half + o, mask=m2, other=0.0)
    return cs, tl.where(offs_d[None, :] < half, -sn, sn)


@triton.jit
def _load_qk(ptr, t, stride_t, offs_c, offs_d, m2, D, CS, MB, ROPE: tl.constexpr):
    """Rows ``t`` of q or k (fp32), turned by the in-mini-batch RoPE when ``ROPE``: x cos + partner(x) (+-sin)."""
    x = _load_rows(ptr, t, stride_t, offs_d, m2)
    if ROPE:
        cs, sn = _rope_table(CS, offs_c, offs_d, m2, D, MB)
        xp = tl.load(ptr + t[:, None] * stride_t + _partner(offs_d, D)[None, :], mask=m2, other=0.0).to(tl.float32)
        x = x * cs + xp * sn
    return x


@triton.jit
def _load_tau(TAU, i, mask, TAU_OFF: tl.constexpr):
    """tau at in-mini-batch positions ``i`` (fp32): as given, or ``max(0, 1 / (i + 1) + offset_i)`` from the offsets
    (``common.token_tau``) when ``TAU_OFF``."""
    x = tl.load(TAU + i, mask=mask, other=0.0).to(tl.float32)
    if TAU_OFF:
        x = tl.maximum(1.0 / (i + 1).to(tl.float32) + x, 0.0)
    return x


@triton.jit
def _tau_grad(dtau, TAU, offs_c, MB, TAU_OFF: tl.constexpr):
    """A partial sum of dtau, as d offset (the max(0, .)'s backward) when ``TAU_OFF``."""
    if TAU_OFF:
        dtau = tl.where(_load_tau(TAU, offs_c, offs_c < MB, TAU_OFF) > 0, dtau, 0.0)
    return dtau


@triton.jit
def _load_lr(ptr, rmask, lr_scale, LR_SIG: tl.constexpr):
    """The per-token rates (fp32): as given, or ``lr_scale * sigmoid(logit)`` from the logits when ``LR_SIG``."""
    x = tl.load(ptr, mask=rmask, other=0.0).to(tl.float32)
    if LR_SIG:
        x = lr_scale / (1.0 + tl.exp(-x))
    return x


@triton.jit
def _unturn(dx, offs_c, offs_d, m2, dmask, D, CS, MB, ROPE: tl.constexpr):
    """The RoPE backward of a gradient tile held in registers: dx cos - partner(dx) (+-sin) (the inverse turn); the
    partner columns through an exact 0/1 permutation product."""
    if ROPE:
        cs, sn = _rope_table(CS, offs_c, offs_d, m2, D, MB)
        perm = ((offs_d[:, None] == _partner(offs_d, D)[None, :]) & dmask[:, None] & dmask[None, :]).to(tl.float32)
        dx = dx * cs - tl.dot(dx, perm, input_precision="ieee") * sn
    return dx


@triton.jit
def _rows(r, s, N, MB, offs_c, dmask):
    """Scan positions s.. of one mini-batch -> token indices (reversed for direction 1) and masks."""
    c = tl.minimum(MB, N - s)
    p = offs_c.to(tl.int64) + s  # int64 token indices: they multiply the input strides
    rmask = offs_c < c
    t = tl.where(r == 0, p, N - 1 - p)
    t = tl.where(rmask, t, 0)
    return t, c, rmask, rmask[:, None] & dmask[None, :]


@triton.jit
def _grad_of_z(z, k, v, lnw, lnb, dmask, m2, D, eps, LN_RES: tl.constexpr):
    """G = d/dz 1/2 ||LN(z) - (v - k)||^2 (or z - v) of the prediction z; rows / columns outside m2 are 0."""
    if LN_RES:
        xh, rstd = _ln_stats(z, dmask, D, eps)
        g = _ln_op((lnw[None, :] * xh + lnb[None, :] - (v - k)) * lnw[None, :], xh, rstd, dmask, D)
    else:
        g = z - v
    return tl.where(m2, g, 0.0)


@triton.jit
def _inner_grad(k, v, w, bias, lnw, lnb, dmask, m2, D, eps, LN_RES: tl.constexpr, PREC: tl.constexpr,
                DOT: tl.constexpr):
    """G of ``_grad_of_z`` for z = k W + b (-v for the dot loss -<z, v>); rows / columns outside m2 are 0."""
    if DOT:
        g = tl.where(m2, -v, 0.0)
    else:
        g = _grad_of_z(tl.dot(k, w, input_precision=PREC) + bias[None, :], k, v, lnw, lnb, dmask, m2, D, eps, LN_RES)
    return g


@triton.jit
def _store_state(ptr, w, bias, offs_d, wmask, dmask, D):
    tl.store(ptr + offs_d[:, None] * D + offs_d[None, :], w, mask=wmask)
    tl.store(ptr + D * D + offs_d, bias, mask=dmask)


@triton.jit
def _program(pid, h, B, H, D, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """From the program ids of (direction x batch) and head: the direction r, batch b, head h, sequence index
    ((direction x batch) x heads + head), all int64, the mini-batch and head-dim offsets, and the head-dim and
    d x d masks."""
    pid, h = pid.to(tl.int64), h.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    return pid // B, pid % B, h, pid * H + h, tl.arange(0, BLOCK_C), offs_d, dmask, dmask[:, None] & dmask[None, :]


@triton.jit
def _seq_inputs(Q, K, V, LR, LNW, LNB, r, b, h,
                sqr, sqb, sqh, skr, skb, skh, svb, svh, slb, slh, D, offs_d, dmask):
    """The head's inner LayerNorm weight and bias (fp32), and the first-token pointers of the sequence in lr, q, k,
    v (q, k per direction), each read with its own strides (r, b, h int64: so are the offsets)."""
    lnw = tl.load(LNW + h * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    lnb = tl.load(LNB + h * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    return (lnw, lnb, LR + b * slb + h * slh, Q + r * sqr + b * sqb + h * sqh, K + r * skr + b * skb + h * skh,
            V + b * svb + h * svh)


@triton.jit(do_not_specialize=[*_STRIDES_NS, "swr", "swb", "sbr", "sbb", "B", "H", "N", "n_mb", "CK", "n_ck"])
def _fwd_states(K, V, LR, TAU, CS, W0, B0, LNW, LNB, G, ST, O,
                sqr, sqb, sqh, sqn, skr, skb, skh, skn, svb, svh, svn, slb, slh, sln, swr, swb, sbr, sbb,
                B, H, N, D, n_mb, CK, n_ck, eps, lr_scale,
                MB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                LN_RES: tl.constexpr, ROPE: tl.constexpr, LR_SIG: tl.constexpr, TAU_OFF: tl.constexpr, PREC: tl.constexpr,
                DOT: tl.constexpr = False, SHARED: tl.constexpr = False):
    """Pass 1, one program per (direction x batch, head), sequential over the mini-batches: only the recurrence
    (z = k W + b, the inner gradient G, the state update).  Writes G (fp32, token order) and the incoming (W; b) of
    every CK-th mini-batch (the chunk starts)."""
    r, b, h, seq, offs_c, offs_d, dmask, wmask = _program(pid64(0), pid64(1), B, H, D, BLOCK_C,
                                                          BLOCK_D)
    w = tl.load(W0 + r * swr + b * swb + h * D * D + offs_d[:, None] * D + offs_d[None, :], mask=wmask,
                other=0.0).to(tl.float32)
    bias = tl.load(B0 + r * sbr + b * sbb + h * D + offs_d, mask=dmask, other=0.0).to(tl.float32)
    lnw, lnb, lrb, _, kb, vb = _seq_inputs(K, K, V, LR, LNW, LNB, r, b, h,
                                           sqr, sqb, sqh, skr, skb, skh, svb, svh, slb, slh, D, offs_d, dmask)
    gb = G + (seq * N) * D
    ob = O + (b * N * H + h) * D  # the (B, N, H, d) output, zeroed here for pass 2's sums (direction 0)
    for m in range(n_mb):
        t, c, rmask, m2 = _rows(r, m * MB, N, MB, offs_c, dmask)
        if m % CK == 0:
            _store_state(ST + (seq * n_ck + m // CK) * (D + 1) * D, w, bias, offs_d, wmask, dmask, D)
        k = _load_qk(kb, t, skn, offs_c, offs_d, m2, D, CS, MB, ROPE)
        v = _load_rows(vb, t, svn, offs_d, m2)
        lr = _load_lr(lrb + t * sln, rmask, lr_scale, LR_SIG)
        tau_last = _load_tau(TAU, c - 1, True, TAU_OFF)
        g = _inner_grad(k, v, w, bias, lnw, lnb, dmask, m2, D, eps, LN_RES, PREC, DOT)
        tl.store(gb + t[:, None] * D + offs_d[None, :], g, mask=m2)
        tl.store(ob + t[:, None] * (H * D) + offs_d[None, :], tl.zeros_like(g), mask=m2 & (r == 0))
        step = (tau_last * lr)[:, None] * g
        w -= tl.dot(tl.trans(k), step, input_precision=PREC)
        bias -= tl.sum(step, 0)


@triton.jit(do_not_specialize=[*_STRIDES_NS, "B", "H", "N", "n_mb", "CK", "n_ck"])
def _fwd_outputs(Q, K, LR, TAU, CS, LNW, LNB, G, ST, O,
                 sqr, sqb, sqh, sqn, skr, skb, skh, skn, svb, svh, svn, slb, slh, sln,
                 B, H, N, D, n_mb, CK, n_ck, eps, lr_scale,
                 MB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                 LN_RES: tl.constexpr, ROPE: tl.constexpr, LR_SIG: tl.constexpr, TAU_OFF: tl.constexpr, PREC: tl.constexpr,
                DOT: tl.constexpr = False, SHARED: tl.constexpr = False):
    """Pass 2, one program per (chunk, direction x batch, head): given G the outputs are a linear recurrence, so
    each chunk starts from its stored (W; b) and walks its CK mini-batches: zb = q W + b - (eta (q k^T + 1)) G, the
    output LayerNorm + residual, W -= k^T (e G), b -= sum e G (the same arithmetic as pass 1)."""
    ck = pid64(0)
    r, b, h, seq, offs_c, offs_d, dmask, wmask = _program(pid64(1), pid64(2), B, H, D, BLOCK_C,
                                                          BLOCK_D)
    sb = ST + (seq * n_ck + ck) * (D + 1) * D
    w = tl.load(sb + offs_d[:, None] * D + offs_d[None, :], mask=wmask, other=0.0)
    bias = tl.load(sb + D * D + offs_d, mask=dmask, other=0.0)
    lnw, lnb, lrb, qb, kb, _ = _seq_inputs(Q, K, K, LR, LNW, LNB, r, b, h,
                                           sqr, sqb, sqh, skr, skb, skh, svb, svh, slb, slh, D, offs_d, dmask)
    gb = G + (seq * N) * D
    ob = O + (b * N * H + h) * D  # (B, N, H, d), zeroed by pass 1
    lo = ck * CK
    hi = tl.minimum(n_mb, lo + CK)
    for m in range(lo, hi):
        # each tile loaded just before its first use (fewer live at once: sm_90 spills), the same arithmetic
        t, c, rmask, m2 = _rows(r, m * MB, N, MB, offs_c, dmask)
        q = _load_qk(qb, t, sqn, offs_c, offs_d, m2, D, CS, MB, ROPE)
        zb = tl.dot(q, w, input_precision=PREC) + bias[None, :]
        k = _load_qk(kb, t, skn, offs_c, offs_d, m2, D, CS, MB, ROPE)
        lr = _load_lr(lrb + t * sln, rmask, lr_scale, LR_SIG)
        tri = (offs_c[None, :] <= offs_c[:, None]) & rmask[:, None] & rmask[None, :]
        eta = tl.where(tri, _load_tau(TAU, offs_c, rmask, TAU_OFF)[:, None] * lr[None, :], 0.0)
        a = eta * (tl.dot(q, tl.trans(k), input_precision=PREC) + 1.0)
        g = _load_rows(gb, t, D, offs_d, m2)
        zb -= tl.dot(a, g, input_precision=PREC)
        if LN_RES:
            xh2, rstd2 = _ln_stats(zb, dmask, D, eps)
            out = q + xh2 * lnw[None, :] + lnb[None, :]
        else:
            out = zb
        # both directions add onto 0: two addends, so the sum is the same in either order (deterministic)
        tl.atomic_add(_at(ob, t * (H * D), offs_d), out, mask=m2, sem="relaxed")
        step = (_load_tau(TAU, c - 1, True, TAU_OFF) * lr)[:, None] * g
        w -= tl.dot(tl.trans(k), step, input_precision=PREC)
        bias -= tl.sum(step, 0)


@triton.jit
def _tok_major(r, b, h, B, H, N, D, t, offs_d):
    """Offsets of rows ``t`` in a (ndir, B, N, H, d) buffer: dq, dk, dv token-major, the layout of the projection
    the inputs are views of (their reshape backward then needs no copy)."""
    return (((r * B + b) * N + t[:, None]) * H + h) * D + offs_d[None, :]


@triton.jit
def _chunk_state(ST, seq, ck, n_ck, D, offs_d, dmask, wmask):
    """The stored incoming (W, b) of chunk ``ck`` of sequence ``seq`` (fp32)."""
    sb = ST + (seq * n_ck + ck) * (D + 1) * D
    return (tl.load(sb + offs_d[:, None] * D + offs_d[None, :], mask=wmask, other=0.0),
            tl.load(sb + D * D + offs_d, mask=dmask, other=0.0))


@triton.jit
def _zero_outputs(GQ, GK, GV, GLR, b, h, B, H, N, D, t, offs_d, rmask, m2, RQ, RK):
    """Zeroes rows ``t`` of the final gradients (every direction slice of dq, dk; dv; dlr), which the later passes
    add onto."""
    zero = tl.where(m2, 0.0, 0.0)
    for s in range(RQ):
        tl.store(GQ + _tok_major(s, b, h, B, H, N, D, t, offs_d), zero, mask=m2)
    for s in range(RK):
        tl.store(GK + _tok_major(s, b, h, B, H, N, D, t, offs_d), zero, mask=m2)
    tl.store(GV + _tok_major(0, b, h, B, H, N, D, t, offs_d), zero, mask=m2)
    tl.store(GLR + (b * H + h) * N + t, tl.where(rmask, 0.0, 0.0), mask=rmask)


@triton.jit
def _finish_qk(DQ, GQ, GK, dk, r, b, h, B, H, N, D, t, offs_d, m2, RQ, RK, SHARED: tl.constexpr):
    """This direction's complete dq (from DQ) and dk into the final gradients (zeroed by ``_zero_outputs``): slice
    min(r, RQ - 1) of dq, or of dk; with ``SHARED`` (q = k) dq + dk into dq.  Relaxed atomic adds of at most two
    addends (one per direction) onto 0: the same sum in either order (deterministic)."""
    dq = tl.load(DQ + _tok_major(r, b, h, B, H, N, D, t, offs_d), mask=m2, other=0.0)
    oq = _tok_major(tl.minimum(r, RQ - 1), b, h, B, H, N, D, t, offs_d)
    if SHARED:
        tl.atomic_add(GQ + oq, dq + dk, mask=m2, sem="relaxed")
    else:
        tl.atomic_add(GQ + oq, dq, mask=m2, sem="relaxed")
        tl.atomic_add(GK + _tok_major(tl.minimum(r, RK - 1), b, h, B, H, N, D, t, offs_d), dk, mask=m2,
                      sem="relaxed")


@triton.jit
def _seg_sum(P, OUT, O, R, M, so, si, pid, BLOCK: tl.constexpr):
    """``OUT[o, j] = sum_i P[o so + i si + j]`` (i < R, in order) for block ``pid`` of the O x M outputs."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < O * M
    base = P + (offs // M) * so + offs % M
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(R):
        acc += tl.load(base + i * si, mask=mask, other=0.0)
    tl.store(OUT + offs, acc, mask=mask)


@triton.jit(do_not_specialize=["r_tau", "r_ln", "m_ln", "o_w", "r_w", "so_w", "si_w", "m_w"])
def _reduce_partials(PTAU, DTAU, PLNW, DLNW, PLNB, DLNB, PW0, DW0, PB0, DB0,
                     r_tau, r_ln, m_ln, o_w, r_w, so_w, si_w, m_w, D, MB: tl.constexpr, BLOCK: tl.constexpr):
    """The one reduction after the backward passes, fixed order (deterministic): dtau from its partial rows, the
    inner LayerNorm's dln_w, dln_b from theirs (over chunks, directions and batch), dW0 (M = H d d) and db0
    (M = H d) over the axes the initial state is shared along (``_state_sums``).  Grid (blocks, 5 tensors)."""
    pid = pid64(0)
    which = pid64(1)
    if which == 0:
        _seg_sum(PTAU, DTAU, 1, r_tau, MB, 0, MB, pid, BLOCK)
    elif which == 1:
        _seg_sum(PLNW, DLNW, 1, r_ln, m_ln, 0, m_ln, pid, BLOCK)
    elif which == 2:
        _seg_sum(PLNB, DLNB, 1, r_ln, m_ln, 0, m_ln, pid, BLOCK)
    elif which == 3:
        _seg_sum(PW0, DW0, o_w, r_w, m_w * D, so_w * D, si_w * D, pid, BLOCK)
    else:
        _seg_sum(PB0, DB0, o_w, r_w, m_w, so_w, si_w, pid, BLOCK)


@triton.jit(do_not_specialize=[*_STRIDES_NS, "sdb", "sdh", "sdn", "B", "H", "N", "n_mb", "CK", "n_ck", "RQ", "RK"])
def _bwd_outputs(Q, K, V, LR, TAU, CS, LNW, LNB, DO, ST, Z, DZB, DGA, DQ, DK, DLR, PTAU, PLNW, PLNB,
                 GQ, GK, GV, GLR,
                 sqr, sqb, sqh, sqn, skr, skb, skh, skn, svb, svh, svn, slb, slh, sln, sdb, sdh, sdn,
                 B, H, N, D, n_mb, CK, n_ck, eps, lr_scale, RQ, RK,
                 MB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                 LN_RES: tl.constexpr, ROPE: tl.constexpr, LR_SIG: tl.constexpr, TAU_OFF: tl.constexpr, PREC: tl.constexpr,
                DOT: tl.constexpr = False, SHARED: tl.constexpr = False):
    """Backward pass 1, one program per (chunk, sequence), in parallel: from the chunk's stored state it walks the
    chunk forward (recomputing z, G and every incoming state) and forms the output-side gradients, which do not
    depend on the later mini-batches: dq (complete), dk's dS^T q term, dlr's eta term, dtau / dln partial sums,
    and writes z, dzb and dG_a = -A^T dzb for the sequential pass."""
    ck = pid64(0)
    r, b, h, seq, offs_c, offs_d, dmask, wmask = _program(pid64(1), pid64(2), B, H, D, BLOCK_C,
                                                          BLOCK_D)
    lnw, lnb, lrb, qb, kb, vb = _seq_inputs(Q, K, V, LR, LNW, LNB, r, b, h,
                                           sqr, sqb, sqh, skr, skb, skh, svb, svh, slb, slh, D, offs_d, dmask)
    w, bias = _chunk_state(ST, seq, ck, n_ck, D, offs_d, dmask, wmask)
    dob = DO + b * sdb + h * sdh  # dout read with its strides (token stride sdn, unit channel stride)
    gb = seq * N  # rows of the per-direction (ndir B, H, N) buffers
    dlnw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dlnb = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dtau = tl.zeros((BLOCK_C,), dtype=tl.float32)
    lo = ck * CK
    hi = tl.minimum(n_mb, lo + CK)
    for m in range(lo, hi):
        # each tile loaded or formed just before its first use and stored as soon as it is final, row offsets held
        # (not row x column ones): fewer registers live at once (sm_90 spills), the same arithmetic
        t, c, rmask, m2 = _rows(r, m * MB, N, MB, offs_c, dmask)
        q = _load_qk(qb, t, sqn, offs_c, offs_d, m2, D, CS, MB, ROPE)
        k = _load_qk(kb, t, skn, offs_c, offs_d, m2, D, CS, MB, ROPE)
        o2 = (gb + t) * D  # rows of the per-direction (ndir B, H, N, d) buffers
        o3 = (((r * B + b) * N + t) * H + h) * D  # rows of the token-major ones (_tok_major)
        if DOT:  # G = -v does not read the state
            g = tl.where(m2, -_load_rows(vb, t, svn, offs_d, m2), 0.0)
        else:  # z and q W + b next to each other (one read of W's operand), z stored at once
            z = tl.dot(k, w, input_precision=PREC) + bias[None, :]
            qw = tl.dot(q, w, input_precision=PREC) + bias[None, :]
            tl.store(_at(Z, o2, offs_d), z, mask=m2)
            g = _grad_of_z(z, k, _load_rows(vb, t, svn, offs_d, m2), lnw, lnb, dmask, m2, D, eps, LN_RES)
        lr = _load_lr(lrb + t * sln, rmask, lr_scale, LR_SIG)
        tau = _load_tau(TAU, offs_c, rmask, TAU_OFF)
        tri = (offs_c[None, :] <= offs_c[:, None]) & rmask[:, None] & rmask[None, :]
        eta = tl.where(tri, tau[:, None] * lr[None, :], 0.0)
        sqk = tl.dot(q, tl.trans(k), input_precision=PREC) + 1.0
        a = eta * sqk
        do = tl.load(dob + t[:, None] * sdn + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        if LN_RES:
            if DOT:
                qw = tl.dot(q, w, input_precision=PREC) + bias[None, :]
            zb = qw - tl.dot(a, g, input_precision=PREC)
            xh2, rstd2 = _ln_stats(zb, dmask, D, eps)
            dlnw += tl.sum(do * xh2, 0)
            dlnb += tl.sum(do, 0)
            dzb = _ln_op(do * lnw[None, :], xh2, rstd2, dmask, D)
            dq = do + tl.dot(dzb, tl.trans(w), input_precision=PREC)
        else:
            dzb = do
            dq = tl.dot(dzb, tl.trans(w), input_precision=PREC)
        dzb = tl.where(m2, dzb, 0.0)
        tl.store(_at(DZB, o2, offs_d), dzb, mask=m2)
        da = tl.where(tri, -tl.dot(dzb, tl.trans(g), input_precision=PREC), 0.0)
        deta = da * sqk
        dsq = da * eta
        tl.store(_at(DGA, o2, offs_d), -tl.dot(tl.trans(a), dzb, input_precision=PREC), mask=m2)
        dq += tl.dot(dsq, k, input_precision=PREC)
        tl.store(_at(DQ, o3, offs_d), _unturn(dq, offs_c, offs_d, m2, dmask, D, CS, MB, ROPE), mask=m2)
        tl.store(_at(DK, o3, offs_d), tl.dot(tl.trans(dsq), q, input_precision=PREC), mask=m2)
        dtau += tl.sum(deta * lr[None, :], 1)
        tl.store(DLR + gb + t, tl.sum(deta * tau[:, None], 0), mask=rmask)
        step = (_load_tau(TAU, c - 1, True, TAU_OFF) * lr)[:, None] * g
        w -= tl.dot(tl.trans(k), step, input_precision=PREC)
        bias -= tl.sum(step, 0)
    if r == 0:  # in a loop of its own: the final gradients' pointers are not held through the one above
        for m in range(lo, hi):
            t, c, rmask, m2 = _rows(r, m * MB, N, MB, offs_c, dmask)
            _zero_outputs(GQ, GK, GV, GLR, b, h, B, H, N, D, t, offs_d, rmask, m2, RQ, RK)
    part = ck * (tl.num_programs(1) * tl.num_programs(2)) + seq  # partial sums: (n_ck + 1, sequences)
    tl.store(PLNW + part * D + offs_d, dlnw, mask=dmask)
    tl.store(PLNB + part * D + offs_d, dlnb, mask=dmask)
    tl.store(PTAU + part * MB + offs_c, _tau_grad(dtau, TAU, offs_c, MB, TAU_OFF), mask=offs_c < MB)


@triton.jit(do_not_specialize=[*_STRIDES_NS, "B", "H", "N", "n_mb", "n_ck", "RQ", "RK"])
def _bwd_states(Q, K, V, LR, TAU, CS, LNW, LNB, Z, DZB, DGA, DZ, DQ, DK, DLR, DW0, DB0, PTAU, PLNW, PLNB,
                GQ, GK, GV, GLR,
                sqr, sqb, sqh, sqn, skr, skb, skh, skn, svb, svh, svn, slb, slh, sln,
                B, H, N, D, n_mb, n_ck, eps, lr_scale, RQ, RK,
                MB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                LN_RES: tl.constexpr, ROPE: tl.constexpr, LR_SIG: tl.constexpr, TAU_OFF: tl.constexpr, PREC: tl.constexpr,
                DOT: tl.constexpr = False, SHARED: tl.constexpr = False):
    """Backward pass 2, one program per sequence, sequential over the mini-batches in reverse: the (dW, db)
    recursion through the state updates and the inner LayerNorm gradient (not linear: it reads z), from the stored
    z, dzb, dG_a; no state is needed.  Writes dz for pass 3, dv, and adds dk's and dlr's recurrence terms."""
    r, b, h, seq, offs_c, offs_d, dmask, wmask = _program(pid64(0), pid64(1), B, H, D, BLOCK_C,
                                                          BLOCK_D)
    lnw, lnb, lrb, qb, kb, vb = _seq_inputs(Q, K, V, LR, LNW, LNB, r, b, h,
                                           sqr, sqb, sqh, skr, skb, skh, svb, svh, slb, slh, D, offs_d, dmask)
    gb = seq * N
    dw = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dlnw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dlnb = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dtau = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for mm in range(n_mb):
        m = n_mb - 1 - mm
        t, c, rmask, m2 = _rows(r, m * MB, N, MB, offs_c, dmask)
        q = _load_qk(qb, t, sqn, offs_c, offs_d, m2, D, CS, MB, ROPE)
        k = _load_qk(kb, t, skn, offs_c, offs_d, m2, D, CS, MB, ROPE)
        lr = _load_lr(lrb + t * sln, rmask, lr_scale, LR_SIG)
        tau_last = _load_tau(TAU, c - 1, True, TAU_OFF)
        o2 = (gb + t[:, None]) * D + offs_d[None, :]
        dzb = tl.load(DZB + o2, mask=m2, other=0.0)
        if DOT:
            g = -_load_rows(vb, t, svn, offs_d, m2)
        elif LN_RES:
            z = tl.load(Z + o2, mask=m2, other=0.0)
            v = _load_rows(vb, t, svn, offs_d, m2)
            xh, rstd = _ln_stats(z, dmask, D, eps)
            y = tl.where(m2, lnw[None, :] * xh + lnb[None, :] - (v - k), 0.0)
            gx = y * lnw[None, :]
            g = _ln_op(gx, xh, rstd, dmask, D)
        else:
            g = tl.load(Z + o2, mask=m2, other=0.0) - _load_rows(vb, t, svn, offs_d, m2)
        g = tl.where(m2, g, 0.0)
        el = tau_last * lr
        pk = tl.dot(k, dw, input_precision=PREC) + db[None, :]
        dg = tl.where(m2, tl.load(DGA + o2, mask=m2, other=0.0) - el[:, None] * pk, 0.0)
        de = -tl.sum(pk * g, 1)
        dk = -tl.dot(el[:, None] * g, tl.trans(dw), input_precision=PREC)
        dtau += tl.where(offs_c == c - 1, tl.sum(de * lr, 0), 0.0)
        if DOT:  # G = -v: no dz, and dk's last term (dz W^T, _bwd_keys) is 0
            dv = -dg
        elif LN_RES:
            dgx = _ln_op(dg, xh, rstd, dmask, D)
            dy = dgx * lnw[None, :]
            # dv = -dy added at once, not held to the end (sm_90 spills)
            tl.atomic_add(GV + _tok_major(0, b, h, B, H, N, D, t, offs_d), -dy, mask=m2, sem="relaxed")
            dlnw += tl.sum(dgx * y + dy * xh, 0)
            dlnb += tl.sum(dy, 0)
            mgx = tl.sum(gx * xh, 1) / D
            dxh = dy * lnw[None, :] - (mgx[:, None] * dg + gx * (tl.sum(dg * xh, 1) / D)[:, None]) * rstd[:, None]
            dz = _ln_op(dxh, xh, rstd, dmask, D) - ((tl.sum(dg * g, 1) * rstd / D)[:, None]) * xh
            dz = tl.where(m2, dz, 0.0)
            dk += dy
        else:
            dz = dg
            dv = -dg
        o3 = _tok_major(r, b, h, B, H, N, D, t, offs_d)
        # dv, dlr: both directions onto the zeroed outputs (two addends: deterministic)
        if DOT or not LN_RES:  # (LN_RES: added above)
            tl.atomic_add(GV + _tok_major(0, b, h, B, H, N, D, t, offs_d), dv, mask=m2, sem="relaxed")
        dk += tl.load(DK + o3, mask=m2, other=0.0)
        if DOT:  # dk is complete here: no _bwd_keys
            _finish_qk(DQ, GQ, GK, _unturn(dk, offs_c, offs_d, m2, dmask, D, CS, MB, ROPE), r, b, h, B, H, N, D, t,
                       offs_d, m2, RQ, RK, SHARED)
        else:
            tl.store(DZ + o2, dz, mask=m2)
            tl.store(DK + o3, dk, mask=m2)
        dlr = tl.load(DLR + gb + t, mask=rmask, other=0.0) + de * tau_last
        if LR_SIG:  # d lr / d logit = lr (1 - sigmoid)
            dlr *= lr * (1.0 - lr / lr_scale)
        tl.atomic_add(GLR + (b * H + h) * N + t, dlr, mask=rmask, sem="relaxed")
        if DOT:
            dw += tl.dot(tl.trans(q), dzb, input_precision=PREC)
            db += tl.sum(dzb, 0)
        else:
            dw += tl.dot(tl.trans(q), dzb, input_precision=PREC) + tl.dot(tl.trans(k), dz, input_precision=PREC)
            db += tl.sum(dzb, 0) + tl.sum(dz, 0)
    tl.store(DW0 + seq * D * D + offs_d[:, None] * D + offs_d[None, :], dw, mask=wmask)
    tl.store(DB0 + seq * D + offs_d, db, mask=dmask)
    part = n_ck * (tl.num_programs(0) * tl.num_programs(1)) + seq
    tl.store(PLNW + part * D + offs_d, dlnw, mask=dmask)
    tl.store(PLNB + part * D + offs_d, dlnb, mask=dmask)
    tl.store(PTAU + part * MB + offs_c, _tau_grad(dtau, TAU, offs_c, MB, TAU_OFF), mask=offs_c < MB)


@triton.jit(do_not_specialize=[*_STRIDES_NS, "B", "H", "N", "n_mb", "CK", "n_ck", "RQ", "RK"])
def _bwd_keys(K, V, LR, TAU, CS, LNW, LNB, ST, Z, DZ, DQ, DK, GQ, GK,
              sqr, sqb, sqh, sqn, skr, skb, skh, skn, svb, svh, svn, slb, slh, sln,
              B, H, N, D, n_mb, CK, n_ck, eps, lr_scale, RQ, RK,
              MB: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
              LN_RES: tl.constexpr, ROPE: tl.constexpr, LR_SIG: tl.constexpr, TAU_OFF: tl.constexpr, PREC: tl.constexpr,
                DOT: tl.constexpr = False, SHARED: tl.constexpr = False):
    """Backward pass 3, one program per (chunk, sequence), in parallel: dk += dz W_i^T, walking the chunk's states
    forward from its stored state with G recomputed from the stored z (no LayerNorm statistics of the state
    itself: z is given)."""
    ck = pid64(0)
    r, b, h, seq, offs_c, offs_d, dmask, wmask = _program(pid64(1), pid64(2), B, H, D, BLOCK_C,
                                                          BLOCK_D)
    lnw, lnb, lrb, _, kb, vb = _seq_inputs(K, K, V, LR, LNW, LNB, r, b, h,
                                           sqr, sqb, sqh, skr, skb, skh, svb, svh, slb, slh, D, offs_d, dmask)
    w, _ = _chunk_state(ST, seq, ck, n_ck, D, offs_d, dmask, wmask)
    gb = seq * N
    lo = ck * CK
    hi = tl.minimum(n_mb, lo + CK)
    for m in range(lo, hi):
        t, c, rmask, m2 = _rows(r, m * MB, N, MB, offs_c, dmask)
        k = _load_qk(kb, t, skn, offs_c, offs_d, m2, D, CS, MB, ROPE)
        v = _load_rows(vb, t, svn, offs_d, m2)
        lr = _load_lr(lrb + t * sln, rmask, lr_scale, LR_SIG)
        tau_last = _load_tau(TAU, c - 1, True, TAU_OFF)
        o2 = (gb + t[:, None]) * D + offs_d[None, :]
        g = _grad_of_z(tl.load(Z + o2, mask=m2, other=0.0), k, v, lnw, lnb, dmask, m2, D, eps, LN_RES)
        dz = tl.load(DZ + o2, mask=m2, other=0.0)
        o3 = _tok_major(r, b, h, B, H, N, D, t, offs_d)
        dk = tl.load(DK + o3, mask=m2, other=0.0) + tl.dot(dz, tl.trans(w), input_precision=PREC)
        _finish_qk(DQ, GQ, GK, _unturn(dk, offs_c, offs_d, m2, dmask, D, CS, MB, ROPE), r, b, h, B, H, N, D, t, offs_d,
                   m2, RQ, RK, SHARED)
        w -= tl.dot(tl.trans(k), (tau_last * lr)[:, None] * g, input_precision=PREC)


def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the Triton TTT-Linear kernels take float32/float16/bfloat16, got {q.dtype}; "
                        f"use backend='torch' for {q.dtype}")


def _bstride(x: torch.Tensor, dim: int) -> int:
    """Stride of a broadcast axis: 0 when the tensor has size 1 there."""
    return 0 if x.shape[dim] == 1 else x.stride(dim)


def _unit_cols(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last (head-dim) axis is unit-strided, the kernels read it with its other strides;
    else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _seq_strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor) -> Tuple[int, ...]:
    """The kernels' stride arguments (``_STRIDES_NS``): q, k (direction, batch, head, token; direction 0 when shared),
    v (batch, head, token), lr (batch, head, token)."""
    return (_bstride(q, 0), *q.stride()[1:4], _bstride(k, 0), *k.stride()[1:4], *v.stride()[:3], *lr.stride())


def _launch_cfg(d: int, mini_batch: int) -> Tuple[int, int, int]:
    block_d = _block_d(d)  # 8 warps from d = 64: fewer sm_90 spills (experiments/compile_kernels.py)
    return _block_d(mini_batch), block_d, (8 if block_d >= 64 else 4)


# (kernel, fp32 activations, BLOCK_D) -> num_warps, num_stages (and a constexpr) where _launch_cfg's warps with
# Triton's 3 stages spill on sm_90 (ptxas -v of every model launch, experiments/compile_kernels.py).  One stage: the
# mini-batch loop's prefetched loads no longer hold registers.  16 warps spill more at d = 64 (the 16-row tiles are
# replicated).  16-bit _bwd_outputs at d = 32: IEEE fp32 FMA dots at 8 warps, as fp32 runs them, instead of TF32
# mma, whose 16-row tiles every warp holds in full (255 registers, 28 bytes spilled; fp32 dots only add precision).
_SM90_CFG = {
    ("_fwd_outputs", True, 64): dict(num_warps=8, num_stages=1),
    ("_bwd_outputs", True, 64): dict(num_warps=8, num_stages=1),
    ("_bwd_states", True, 64): dict(num_warps=8, num_stages=1),
    ("_bwd_outputs", True, 32): dict(num_warps=8, num_stages=1),
    ("_bwd_states", True, 32): dict(num_warps=4, num_stages=1),
    ("_bwd_outputs", False, 32): dict(num_warps=8, num_stages=1, PREC="ieee"),
    ("_bwd_states", False, 32): dict(num_warps=8, num_stages=1),
}


def _kernel_opts(cfg: Dict[str, object], kernel: str, dtype: torch.dtype, d: int, mini_batch: int
                 ) -> Dict[str, object]:
    """The constexprs ``cfg`` and num_warps, num_stages of one scan kernel: _SM90_CFG where it has a row, else
    _launch_cfg's warps and 3 stages."""
    _, block_d, warps = _launch_cfg(d, mini_batch)
    return {**cfg, "num_warps": warps, "num_stages": 3,
            **_SM90_CFG.get((kernel, dtype == torch.float32, block_d), {})}


def _chunks(n: int, mini_batch: int) -> Tuple[int, int, int]:
    """Mini-batches, mini-batches per chunk (= per saved checkpoint, ``torch.ckpt_every``) and chunks."""
    n_mb = triton.cdiv(n, mini_batch)
    ck = ckpt_every(n_mb)
    return n_mb, ck, triton.cdiv(n_mb, ck)


def scan_grids(ndir: int, bsz: int, heads: int, n: int, mini_batch: int) -> Dict[str, Tuple[int, ...]]:
    """The launch grid of every kernel for ``n`` tokens: the recurrences (``_fwd_states``, ``_bwd_states``) one
    program per sequence (direction x batch, head); the others one per (chunk, sequence), growing with N."""
    seqs = (ndir * bsz, heads)
    chunks = (_chunks(n, mini_batch)[2], *seqs)
    return {"_fwd_states": seqs, "_fwd_outputs": chunks, "_bwd_outputs": chunks, "_bwd_states": seqs,
            "_bwd_keys": chunks}


def scan_fwd_triton(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir: int, mini_batch: int, ln_residual: bool,
                    eps: float, save_states: bool, rope_table: Optional[torch.Tensor] = None, lr_scale: float = 0.0,
                    tau_offset: bool = False, dot_loss: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton forward of the general contract (see ``torch.py``): pass 1 (states, G), pass 2 (outputs)."""
    _check_dtype(q)
    _, bsz, h, n, d = q.shape
    q, k, v = _unit_cols(q), _unit_cols(k), _unit_cols(v)  # read with their strides: no copy of the views
    tau, w0, b0 = tau.contiguous(), w0.contiguous(), b0.contiguous()
    ln_w, ln_b = ln_w.contiguous(), ln_b.contiguous()
    n_mb, ck, n_ck = _chunks(n, mini_batch)
    f32 = dict(device=q.device, dtype=torch.float32)
    out = torch.empty(bsz, n, h, d, **f32)  # both directions summed, token-major: (B, N, C) for the caller
    grad = torch.empty(ndir, bsz, h, n, d, **f32)  # the inner gradients G (pass 1 -> pass 2)
    st = torch.empty(ndir * bsz, h, n_ck, d + 1, d, **f32)  # chunk-start states = the backward's checkpoints
    block_c, block_d, _ = _launch_cfg(d, mini_batch)
    grids = scan_grids(ndir, bsz, h, n, mini_batch)
    cfg = dict(MB=mini_batch, BLOCK_C=block_c, BLOCK_D=block_d, LN_RES=ln_residual, ROPE=rope_table is not None,
               LR_SIG=lr_scale != 0, TAU_OFF=tau_offset, PREC=_prec(q.dtype), DOT=dot_loss, SHARED=False)
    opts = partial(_kernel_opts, cfg, dtype=q.dtype, d=d, mini_batch=mini_batch)
    cs = tau if rope_table is None else rope_table.contiguous()  # any pointer when there is no RoPE
    _fwd_states[grids["_fwd_states"]](
        k, v, lr, tau, cs, w0, b0, ln_w, ln_b, grad, st, out,
        *_seq_strides(q, k, v, lr), _bstride(w0, 0), _bstride(w0, 1), _bstride(b0, 0), _bstride(b0, 1),
        bsz, h, n, d, n_mb, ck, n_ck, eps, lr_scale, **opts("_fwd_states"))
    _fwd_outputs[grids["_fwd_outputs"]](
        q, k, lr, tau, cs, ln_w, ln_b, grad, st, out,
        *_seq_strides(q, k, v, lr),
        bsz, h, n, d, n_mb, ck, n_ck, eps, lr_scale, **opts("_fwd_outputs"))
    return out.to(q.dtype).transpose(1, 2), (st if save_states else torch.empty(0, **f32))


def _state_sums(like: torch.Tensor, ndir: int, bsz: int) -> Tuple[int, int, int, int]:
    """(O, R, so, si) of ``_seg_sum`` (in units of one head's block) that sums the per-sequence (ndir, B) gradient of
    the initial state to ``like``'s (1 | ndir, 1 | B) leading axes."""
    per_dir, per_sample = like.shape[0] != 1, like.shape[1] != 1
    if per_dir and per_sample:
        return ndir * bsz, 1, 1, 0
    if per_dir:
        return ndir, bsz, bsz, 1
    if per_sample:
        return bsz, ndir, 1, bsz
    return 1, ndir * bsz, 0, 1


def scan_bwd_triton(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir: int, mini_batch: int,
                    ln_residual: bool, eps: float, rope_table: Optional[torch.Tensor] = None, lr_scale: float = 0.0,
                    tau_offset: bool = False, dot_loss: bool = False, shared_qk: bool = False) -> List[torch.Tensor]:
    """Triton backward of the general contract: [dq, dk, dv, dlr, dtau, dw0, db0, dln_w, dln_b], in three launches
    (per chunk, per sequence, per chunk; module docstring; two for the dot loss) and one reduction of the partial
    sums.  ``shared_qk`` (k is q): dq holds dq + dk and dk is empty."""
    _check_dtype(q)
    _, bsz, h, n, d = q.shape
    if states.numel() == 0:
        raise RuntimeError("ttt_linear backward needs the forward's per-mini-batch states (save_states=True)")
    q, k, v, do = _unit_cols(q), _unit_cols(k), _unit_cols(v), _unit_cols(do)
    tau, ln_w, ln_b, states = tau.contiguous(), ln_w.contiguous(), ln_b.contiguous(), states.contiguous()
    n_mb, ck, n_ck = _chunks(n, mini_batch)
    if states.shape[2] != n_ck:
        raise ValueError(f"states hold {states.shape[2]} checkpoints, expected {n_ck} for {n_mb} mini-batches")
    f32 = dict(device=q.device, dtype=torch.float32)
    # per direction, fp32, handed from pass to pass: dq, dk (token-major, _tok_major), dlr, z, dzb, dG_a, dz
    dq, dk = [torch.empty(ndir, bsz, n, h, d, **f32) for _ in range(2)]
    dzb, dga = [torch.empty(ndir, bsz, h, n, d, **f32) for _ in range(2)]
    # z and dz only for the state-dependent losses (the dot loss's G = -v reads neither)
    z, dz = [dzb if dot_loss else torch.empty_like(dzb) for _ in range(2)]
    dlr = torch.empty(ndir, bsz, h, n, **f32)
    # the gradients (fp32): dq, dk, dv, dlr zeroed by pass 1 and summed over the directions by the later passes
    rq, rk = q.shape[0], k.shape[0]
    gq = torch.empty(rq, bsz, n, h, d, **f32)
    gk = gq if shared_qk else torch.empty(rk, bsz, n, h, d, **f32)
    gv = torch.empty(bsz, n, h, d, **f32)
    glr = torch.empty(bsz, h, n, **f32)
    seqs = ndir * bsz * h
    ptau = torch.empty(n_ck + 1, seqs, mini_batch, **f32)  # partial sums: one row per chunk program, one for pass 2
    plnw, plnb = [torch.empty(n_ck + 1, seqs, d, **f32) for _ in range(2)]
    pw0 = torch.empty(seqs, d, d, **f32)
    pb0 = torch.empty(seqs, d, **f32)
    block_c, block_d, _ = _launch_cfg(d, mini_batch)
    grids = scan_grids(ndir, bsz, h, n, mini_batch)
    cfg = dict(MB=mini_batch, BLOCK_C=block_c, BLOCK_D=block_d, LN_RES=ln_residual, ROPE=rope_table is not None,
               LR_SIG=lr_scale != 0, TAU_OFF=tau_offset, PREC=_prec(q.dtype), DOT=dot_loss, SHARED=shared_qk)
    opts = partial(_kernel_opts, cfg, dtype=q.dtype, d=d, mini_batch=mini_batch)
    cs = tau if rope_table is None else rope_table.contiguous()  # any pointer when there is no RoPE
    strides = _seq_strides(q, k, v, lr)
    _bwd_outputs[grids["_bwd_outputs"]](
        q, k, v, lr, tau, cs, ln_w, ln_b, do, states, z, dzb, dga, dq, dk, dlr, ptau, plnw, plnb, gq, gk, gv, glr,
        *strides, do.stride(0), do.stride(1), do.stride(2), bsz, h, n, d, n_mb, ck, n_ck, eps, lr_scale, rq, rk,
        **opts("_bwd_outputs"))
    _bwd_states[grids["_bwd_states"]](
        q, k, v, lr, tau, cs, ln_w, ln_b, z, dzb, dga, dz, dq, dk, dlr, pw0, pb0, ptau, plnw, plnb, gq, gk, gv, glr,
        *strides, bsz, h, n, d, n_mb, n_ck, eps, lr_scale, rq, rk, **opts("_bwd_states"))
    if not dot_loss:  # dot loss: dz = 0, _bwd_states completes dk
        _bwd_keys[grids["_bwd_keys"]](
            k, v, lr, tau, cs, ln_w, ln_b, states, z, dz, dq, dk, gq, gk,
            *strides, bsz, h, n, d, n_mb, ck, n_ck, eps, lr_scale, rq, rk, **opts("_bwd_keys"))
    dtau = torch.empty(mini_batch, **f32)
    dlnw, dlnb = torch.empty(h, d, **f32), torch.empty(h, d, **f32)
    dw0 = torch.empty(w0.shape, **f32)
    db0 = torch.empty(b0.shape, **f32)
    o_w, r_w, so_w, si_w = _state_sums(w0, ndir, bsz)
    block = 1024
    most = max(mini_batch, h * d, o_w * h * d * d)
    _reduce_partials[(triton.cdiv(most, block), 5)](
        ptau, dtau, plnw, dlnw, plnb, dlnb, pw0, dw0, pb0, db0, (n_ck + 1) * seqs, (n_ck + 1) * ndir * bsz, h * d,
        o_w, r_w, so_w * h * d, si_w * h * d, h * d, d, MB=mini_batch, BLOCK=block, num_warps=4)
    return [gq.to(q.dtype).transpose(2, 3), (k.new_empty(0) if shared_qk else gk.to(k.dtype).transpose(2, 3)),
            gv.to(v.dtype).transpose(1, 2), glr.to(lr.dtype), dtau.to(tau.dtype), dw0.to(w0.dtype),
            db0.to(b0.dtype), dlnw.to(ln_w.dtype), dlnb.to(ln_b.dtype)]
