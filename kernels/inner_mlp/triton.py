"""Triton kernels of the T5 (gated SwiGLU, dot-product loss) and DiT5 (SiLU MLP, regression loss) inner steps.

One kernel family for both inner models; ``GATED`` (constexpr) switches between them (see ``torch.py`` for the
formulas, which these kernels follow line by line).  Weight slots: A = W1, B = W2 (gated only), O = the output
layer (T5: W3, DiT5: W2).  q, k, v may be any strided (B, heads, N, d) views (the heads split of the qkv output is
never copied); loads are upcast to float32, every product and reduction accumulates in float32 (``tl.dot`` in IEEE
fp32 for fp32 inputs, TF32 for fp16/bf16), results are stored in the input dtype.  d is padded to a power of two
D >= 16 (d = 72 -> 128) and masked; N is tiled by BLOCK_N and masked.  Nothing of size N x d x d and no per-token
weight is ever written to memory.

Passes, per (batch, head):
  fwd 1 ``_vjp`` (UPDATE): z = k W, silu, h, e (DiT5: f = h O, e = c (f - v)), dh = e O^T and the weight gradients
      G = k^T (..), h^T e, fused per token tile; each program reduces TILES tiles into fp32 partials (one d x d per
      weight per chunk), summed in PyTorch; W' = W - G on the tiny d x d tensors.
  fwd 2 ``_apply``: out = silu(q W1') [* q W2'] O', fused; reads q once, writes out once.
  bwd 3 ``_vjp``: recomputes y = q W', writes dq, reduces dW' (2 or 3 d x d) into partials (pass 1's algebra with
      k -> q and e -> dO).
  bwd 4 ``_update_bwd``: recomputes z, silu, silu', silu'', h, e, dh from k, v, W; writes dk, dv, reduces the
      gradient through G into dW partials.
  Token tiles: 64 (apply, update) and 32 (backward) for d <= 64; 32 / 16 / 16 for d = 72 (D = 128): chosen from
  ptxas register / spill reports for sm_90 (``experiments/compile_kernels.py``, results in experiments/results/); 8 warps
  for D >= 64.  Every reduction chunk spans TILES * BLOCK_N = 256 tokens.
  Saved for the backward: q, k, v, W and W' (2 or 3 d x d fp32 per (batch, head)).  Extra memory per (batch, head):
  W' and 2 or 3 fp32 d x d partials per chunk of TILES * BLOCK_N tokens; O(N d) only for out / dq / dk / dv.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import triton
import triton.language as tl

from ..backend import MAX_HEAD_DIM
from ..triton_utils import block_d as _block_d, load_mat, load_tile, load_tile_pair, prec as _prec, store_mat, \
    store_tile, tile_rows, wstrides as _wstrides
from .torch import _check, compute_dtype, make_function, model_entry_points

__all__ = ["inner_fwd_triton", "inner_bwd_triton", "t5_fwd_triton", "t5_bwd_triton", "dit5_fwd_triton",
           "dit5_bwd_triton", "t5_swiglu_ttt_triton", "mlp_ttt_triton"]

BLOCK_N = 64      # tokens per tile (32 when d pads to 128)
TILES = 4         # tiles reduced per program in the reduction kernels


def _block_n(bd: int, pass_: str) -> int:
    """Tokens per tile, chosen from ptxas register/spill reports for sm_90 (experiments/compile_kernels.py): the
    backward kernels hold more d x d matrices, so they take shorter token tiles."""
    cap = {"apply": (64, 32), "update": (64, 16), "bwd": (32, 16)}[pass_][1 if bd > 64 else 0]
    return min(BLOCK_N, cap)


def _tiles(bn: int) -> int:
    """Tiles per reduction program: every pass reduces chunks of TILES * BLOCK_N tokens."""
    return max(1, TILES * BLOCK_N // bn)


def _warps(bd: int) -> int:
    """More warps for the larger d x d register sets (the backward update keeps 6 matrices + 3 accumulators)."""
    return 8 if bd >= 64 else 4


# ------------------------------------------------------------------------------------------- shared helpers
@triton.jit
def _load_weights(WA, WB, WO, base, offs_d, sr, sc, D, GATED: tl.constexpr):
    """The 2 (MLP) or 3 (gated) d x d weights of one (batch, head); wb = wa when not gated (unused)."""
    wa = load_mat(WA, base, offs_d, offs_d, sr, sc, D)
    wo = load_mat(WO, base, offs_d, offs_d, sr, sc, D)
    if GATED:
        wb = load_mat(WB, base, offs_d, offs_d, sr, sc, D)
    else:
        wb = wa
    return wa, wb, wo


@triton.jit
def _store_partials(PA, PB, PO, base, ga, gb, go, offs_d, D, GATED: tl.constexpr):
    store_mat(PA, base, ga, offs_d, offs_d, D)
    store_mat(PO, base, go, offs_d, offs_d, D)
    if GATED:
        store_mat(PB, base, gb, offs_d, offs_d, D)


@triton.jit
def _zeros3(BLOCK_D: tl.constexpr):
    """Three fp32 d x d accumulators (the partials of A, B, O)."""
    shape: tl.constexpr = (BLOCK_D, BLOCK_D)
    return tl.zeros(shape, dtype=tl.float32), tl.zeros(shape, dtype=tl.float32), tl.zeros(shape, dtype=tl.float32)


@triton.jit
def _hidden(x, wa, wb, GATED: tl.constexpr, PREC: tl.constexpr):
    """z1 = x A, silu(z1), silu'(z1), sigmoid(z1), the gate z2 = x B (or z1) and the hidden h."""
    z1 = tl.dot(x, wa, input_precision=PREC)
    s = tl.sigmoid(z1)
    a = z1 * s
    da = s * (1.0 + z1 * (1.0 - s))
    if GATED:
        z2 = tl.dot(x, wb, input_precision=PREC)
        h = a * z2
    else:
        z2 = z1
        h = a
    return z1, a, da, s, z2, h


@triton.jit
def _residual(h, v, wo, c, GATED: tl.constexpr, PREC: tl.constexpr):
    """e = dL/df: T5 c v (c = -scale / N), DiT5 c (h O - v) (c = scale / N)."""
    if GATED:
        e = v * c
    else:
        e = (tl.dot(h, wo, input_precision=PREC) - v) * c
    return e


# ------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _vjp(X, Y, WA, WB, WO, DX, PA, PB, PO,
         sxb, sxh, sxn, sxd, syb, syh, syn, syd, swb, swh, swr, swc, sdb, sdh, sdn, sdd,
         H, N, D, n_chunks, c,
         GATED: tl.constexpr, UPDATE: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """Partials of the weight gradients of f = hidden(x) O for a cotangent e of f, reduced over TILES tiles.
    ``UPDATE`` (fwd pass 1): x = k, e = the inner loss gradient from y = v (:func:`_residual`), the partials are G.
    Otherwise (bwd pass 3): x = q, e = y = dO, W = W', the partials are dW', and dx = dq is written."""
    pid, chunk = tl.program_id(0), tl.program_id(1)
    b, h = pid // H, pid % H
    offs_d = tl.arange(0, BLOCK_D)
    wa, wb, wo = _load_weights(WA, WB, WO, b * swb + h * swh, offs_d, swr, swc, D, GATED)
    ga, gb, go = _zeros3(BLOCK_D)
    for t in range(TILES):
        offs_n = tile_rows(chunk, t, TILES, BLOCK_N)
        x, y = load_tile_pair(X, Y, b * sxb + h * sxh, b * syb + h * syh, offs_n, offs_d, offs_d, sxn, sxd, syn,
                              syd, N, D)
        z1, a, da, s, z2, hid = _hidden(x, wa, wb, GATED, PREC)
        if UPDATE:
            e = _residual(hid, y, wo, c, GATED, PREC)
        else:
            e = y
        dh = tl.dot(e, tl.trans(wo), input_precision=PREC)
        xt = tl.trans(x)
        if GATED:
            dya = dh * z2 * da
            dyb = dh * a
            gb += tl.dot(xt, dyb, input_precision=PREC)
        else:
            dya = dh * da
        ga += tl.dot(xt, dya, input_precision=PREC)
        go += tl.dot(tl.trans(hid), e, input_precision=PREC)
        if not UPDATE:
            if GATED:
                dx = tl.dot(dya, tl.trans(wa), input_precision=PREC) + tl.dot(dyb, tl.trans(wb), input_precision=PREC)
            else:
                dx = tl.dot(dya, tl.trans(wa), input_precision=PREC)
            store_tile(DX, b * sdb + h * sdh, dx, offs_n, offs_d, sdn, sdd, N, D)
    _store_partials(PA, PB, PO, (pid * n_chunks + chunk) * D * D, ga, gb, go, offs_d, D, GATED)


@triton.jit
def _apply(Q, WA, WB, WO, O,
           sqb, sqh, sqn, sqd, sob, soh, son, sod,
           H, N, D,
           GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    pid, tile = tl.program_id(0), tl.program_id(1)
    b, h = pid // H, pid % H
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    wa, wb, wo = _load_weights(WA, WB, WO, pid * D * D, offs_d, D, 1, D, GATED)
    q = load_tile(Q, b * sqb + h * sqh, offs_n, offs_d, sqn, sqd, N, D)
    z1, a, da, s, z2, hid = _hidden(q, wa, wb, GATED, PREC)
    out = tl.dot(hid, wo, input_precision=PREC)
    store_tile(O, b * sob + h * soh, out, offs_n, offs_d, son, sod, N, D)


@triton.jit
def _update_bwd(K, V, WA, WB, WO, DA, DB, DG, DK, DV, PA, PB, PO,
                skb, skh, skn, skd, svb, svh, svn, svd, swb, swh, swr, swc,
                sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
                H, N, D, n_chunks, c,
                GATED: tl.constexpr, TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                PREC: tl.constexpr):
    """DA, DB, DG: cotangents of the inner gradients G_A, G_B, G_O (contiguous (B, heads, d, d) fp32)."""
    pid, chunk = tl.program_id(0), tl.program_id(1)
    b, h = pid // H, pid % H
    offs_d = tl.arange(0, BLOCK_D)
    wa, wb, wo = _load_weights(WA, WB, WO, b * swb + h * swh, offs_d, swr, swc, D, GATED)
    cta, ctb, cto = _load_weights(DA, DB, DG, pid * D * D, offs_d, D, 1, D, GATED)
    ga, gb, go = _zeros3(BLOCK_D)
    for t in range(TILES):
        offs_n = tile_rows(chunk, t, TILES, BLOCK_N)
        k, v = load_tile_pair(K, V, b * skb + h * skh, b * svb + h * svh, offs_n, offs_d, offs_d, skn, skd, svn,
                              svd, N, D)
        z1, a, da, s, z2, hid = _hidden(k, wa, wb, GATED, PREC)
        d2a = s * (1.0 - s) * (2.0 + z1 * (1.0 - 2.0 * s))
        e = _residual(hid, v, wo, c, GATED, PREC)
        dh = tl.dot(e, tl.trans(wo), input_precision=PREC)
        dpa = tl.dot(k, cta, input_precision=PREC)
        dha = tl.dot(e, tl.trans(cto), input_precision=PREC)
        de = tl.dot(hid, cto, input_precision=PREC)
        if GATED:
            dpb = tl.dot(k, ctb, input_precision=PREC)
            dk = tl.dot(dh * z2 * da, tl.trans(cta), input_precision=PREC)
            dk += tl.dot(dh * a, tl.trans(ctb), input_precision=PREC)
            ddh = dpa * z2 * da + dpb * a
            dz2 = dpa * dh * da + dha * a
            dz1 = dpa * dh * z2 * d2a + dpb * dh * da + dha * z2 * da
            de += tl.dot(ddh, wo, input_precision=PREC)
            dv = de * c
            dk += tl.dot(dz1, tl.trans(wa), input_precision=PREC) + tl.dot(dz2, tl.trans(wb), input_precision=PREC)
            gb += tl.dot(tl.trans(k), dz2, input_precision=PREC)
        else:
            dk = tl.dot(dh * da, tl.trans(cta), input_precision=PREC)
            ddh = dpa * da
            de += tl.dot(ddh, wo, input_precision=PREC)
            df = de * c
            dv = -df
            dz1 = dpa * dh * d2a + (dha + tl.dot(df, tl.trans(wo), input_precision=PREC)) * da
            dk += tl.dot(dz1, tl.trans(wa), input_precision=PREC)
            go += tl.dot(tl.trans(hid), df, input_precision=PREC)
        go += tl.dot(tl.trans(ddh), e, input_precision=PREC)
        ga += tl.dot(tl.trans(k), dz1, input_precision=PREC)
        store_tile(DK, b * sdkb + h * sdkh, dk, offs_n, offs_d, sdkn, sdkd, N, D)
        store_tile(DV, b * sdvb + h * sdvh, dv, offs_n, offs_d, sdvn, sdvd, N, D)
    _store_partials(PA, PB, PO, (pid * n_chunks + chunk) * D * D, ga, gb, go, offs_d, D, GATED)


# ------------------------------------------------------------------------------------------------ launchers
def _slots(ws: Sequence[torch.Tensor]):
    """(A, B, O) slots: B aliases A for the 2-layer MLP (never read)."""
    return (ws[0], ws[1], ws[2]) if len(ws) == 3 else (ws[0], ws[0], ws[1])


def _partials(bh: int, chunks: int, d: int, n_w: int, device) -> List[torch.Tensor]:
    return [torch.empty(bh, chunks, d, d, device=device, dtype=torch.float32) for _ in range(n_w)]


def _sum_partials(p: List[torch.Tensor], b: int, h: int, d: int) -> List[torch.Tensor]:
    return [t.sum(1).reshape(b, h, d, d) for t in p]


def _heads_merged(b: int, h: int, n: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, d) view of a (B, N, heads, d) buffer: merging the heads afterwards is free."""
    return torch.empty(b, n, h, d, device=like.device, dtype=like.dtype).transpose(1, 2)


def inner_fwd_triton(q, k, v, ws: Sequence[torch.Tensor], scale: float, gated: bool):
    """Triton forward: (out (B, heads, N, d) in q's dtype, [W'] fp32 (B, heads, d, d) contiguous)."""
    op = "t5_swiglu_ttt" if gated else "dit5_mlp_ttt"
    _check(q, k, v, ws, op)
    b, h, n, d = q.shape
    if d > MAX_HEAD_DIM[op]:  # the shared memory of the backward would not fit (backend.MAX_HEAD_DIM)
        raise ValueError(f"{op}: the Triton kernel takes head dims up to {MAX_HEAD_DIM[op]}, got {d}; use the "
                         f"PyTorch path (backend='torch' or 'auto')")
    bd, prec = _block_d(d), _prec(q.dtype)
    bn, bn_apply = _block_n(bd, "update"), _block_n(bd, "apply")
    tiles = _tiles(bn)
    chunks = triton.cdiv(n, tiles * bn)
    p = _partials(b * h, chunks, d, 3, q.device) if gated else _partials(b * h, chunks, d, 2, q.device)
    pa, pb, po = _slots(p)
    wa, wb, wo = _slots(ws)
    c = (-scale if gated else scale) / n
    _vjp[(b * h, chunks)](k, v, wa, wb, wo, pa, pa, pb, po, *k.stride(), *v.stride(), *_wstrides(ws[0]),
                          0, 0, 0, 0, h, n, d, chunks, c, GATED=gated, UPDATE=True, TILES=tiles, BLOCK_N=bn,
                          BLOCK_D=bd, PREC=prec, num_warps=_warps(bd))
    gs = _sum_partials(p, b, h, d)
    wn = [(w.float() - g).expand(b, h, d, d).contiguous() for w, g in zip(ws, gs)]
    out = _heads_merged(b, h, n, d, q)
    na, nb, no = _slots(wn)
    _apply[(b * h, triton.cdiv(n, bn_apply))](q, na, nb, no, out, *q.stride(), *out.stride(), h, n, d,
                                              GATED=gated, BLOCK_N=bn_apply, BLOCK_D=bd, PREC=prec,
                                              num_warps=_warps(bd))
    return out, wn


def inner_bwd_triton(do, q, k, v, ws: Sequence[torch.Tensor], wn: Sequence[torch.Tensor], scale: float,
                     gated: bool):
    """Triton backward: [dq, dk, dv, dW...]; recomputes every N x d intermediate from q, k, v, W and W'."""
    b, h, n, d = q.shape
    bd, prec = _block_d(d), _prec(q.dtype)
    bn = _block_n(bd, "bwd")
    tiles = _tiles(bn)
    chunks = triton.cdiv(n, tiles * bn)
    n_w = len(ws)
    wn = [w.float().expand(b, h, d, d).contiguous() for w in wn]
    dq = _heads_merged(b, h, n, d, q)
    p = _partials(b * h, chunks, d, n_w, q.device)
    pa, pb, po = _slots(p)
    na, nb, no = _slots(wn)
    _vjp[(b * h, chunks)](q, do, na, nb, no, dq, pa, pb, po, *q.stride(), *do.stride(), h * d * d, d * d, d, 1,
                          *dq.stride(), h, n, d, chunks, 1.0, GATED=gated, UPDATE=False, TILES=tiles, BLOCK_N=bn,
                          BLOCK_D=bd, PREC=prec, num_warps=_warps(bd))
    dwn = _sum_partials(p, b, h, d)
    cts = [(-t).contiguous() for t in dwn]  # cotangents of G (W' = W - G)
    ca, cb, co = _slots(cts)
    dk, dv = _heads_merged(b, h, n, d, q), _heads_merged(b, h, n, d, q)
    wa, wb, wo = _slots(ws)
    c = (-scale if gated else scale) / n
    _update_bwd[(b * h, chunks)](k, v, wa, wb, wo, ca, cb, co, dk, dv, pa, pb, po, *k.stride(), *v.stride(),
                                 *_wstrides(ws[0]), *dk.stride(), *dv.stride(), h, n, d, chunks, c,
                                 GATED=gated, TILES=tiles, BLOCK_N=bn, BLOCK_D=bd, PREC=prec,
                             num_warps=_warps(bd))
    dws = []
    for w, a_, b_ in zip(ws, dwn, _sum_partials(p, b, h, d)):
        t = a_ + b_
        if w.shape[0] == 1:
            t = t.sum(0, keepdim=True)
        dws.append(t.to(w.dtype))
    return [dq, dk, dv] + dws


t5_fwd_triton, t5_bwd_triton, dit5_fwd_triton, dit5_bwd_triton = model_entry_points(inner_fwd_triton,
                                                                                     inner_bwd_triton)


# differentiable entry points straight over the kernels, without the custom op (the kernel tests use them)
T5TTTTriton = make_function("T5TTTTriton", t5_fwd_triton, t5_bwd_triton, 3)
DiT5TTTTriton = make_function("DiT5TTTTriton", dit5_fwd_triton, dit5_bwd_triton, 2)


def t5_swiglu_ttt_triton(q, k, v, w1, w2, w3, scale: float) -> torch.Tensor:
    return T5TTTTriton.apply(q, k, v, w1, w2, w3, float(scale))


def mlp_ttt_triton(q, k, v, w1, w2, scale: float) -> torch.Tensor:
    return DiT5TTTTriton.apply(q, k, v, w1, w2, float(scale))
