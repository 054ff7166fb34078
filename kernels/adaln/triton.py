"""Triton kernels of the adaLN glue on (B, N, C) tokens (see ``naive.py``): one launch forward per function, two
backward (one for ``gate_residual``), deterministic (no atomics).

Row tiles of BLOCK_R tokens x the whole row (BLOCK_C = next_power_of_2(C) >= C channels): the LayerNorm statistics
of a token are one in-register reduction.  Grid (row tiles, B): a program's tokens share one sample, so its (B, C)
vectors (strided views allowed: their batch stride is an argument, the channel stride is 1) are loaded once.
Offsets are int64 (program ids through ``pid64``, the token index ``b N + n`` built from them); N, B and the
chunking are not specialised (``jit_sizes``).  The incoming gradients are read through their strides (no copy:
``.sum().backward()`` hands an expanded one), the tokens and outputs are contiguous.  Arithmetic in fp32, every
product formed in fp32 before the cast.
  ``_fwd``: h = LN(x) (1 + scale) + shift, mean and rstd (B, N) fp32; with GATED first x1 = x + gate y (stored,
      and normalised as stored).  ``_gate_fwd``: x + gate y.
  ``_bwd``: program (chunk, b) walks ``n_tiles`` row tiles: d = g_x1 + rstd (g - mean_c g - xhat mean_c(g xhat))
      with g = g_h (1 + scale); writes dx = d (and dy = d gate with GATED), and its column sums of g_h, g_h xhat
      (and d y) to a (B n_chunks, K, C) fp32 buffer.  ``_reduce``: one launch sums them over the chunks in a fixed
      order and writes dshift, dscale (dgate) in their own dtypes.
  ``_gate_bwd``: grid (B, channel blocks), each program loops over the N tokens: dy = g gate, dgate = sum_n g y.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..triton_utils import jit_sizes, pid64
from .torch import out_dtype

__all__ = ["modulate_norm_fwd_triton", "modulate_norm_bwd_triton", "gate_residual_fwd_triton",
           "gate_residual_bwd_triton", "gate_residual_modulate_norm_fwd_triton",
           "gate_residual_modulate_norm_bwd_triton", "row_cfg"]

TILE = 4096  # elements of a row tile (BLOCK_R x BLOCK_C)
MAX_ROWS = 16
TARGET_PROGRAMS = 512  # backward programs aimed at (bounds the partials: TARGET_PROGRAMS x 3 x C fp32)
BLOCK_P = 16  # partial rows summed per step of the reduction
RED_BLOCK_C = 256  # channels per program of the reduction
GATE_BLOCK_T, GATE_BLOCK_C = 32, 128  # gate_residual's backward tile (tokens x channels)
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second axis


def row_cfg(c: int) -> Tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, warps) for rows of C channels: 8 warps from a full tile (16 fp32 values a thread per tile
    tensor; the backward holds about six), 4 below (C <= 128)."""
    block_c = max(16, triton.next_power_of_2(c))
    block_r = max(1, min(MAX_ROWS, TILE // block_c))
    return block_r, block_c, 8 if block_r * block_c >= TILE else 4


@triton.jit
def _row_tile(b, r0, N, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(token index b N + n (int64), row mask, column offsets, column mask, tile offsets, tile mask)."""
    rows = r0 + tl.arange(0, BLOCK_R)
    rm = rows < N
    tok = b * N + rows
    cols = tl.arange(0, BLOCK_C)
    cm = cols < C
    return tok, rm, cols, cm, tok[:, None] * C + cols[None, :], rm[:, None] & cm[None, :]


@triton.jit
def _vec(V, b, s_b, cols, cm):
    """Row b of a (B, C) vector of batch stride ``s_b`` (channel stride 1), fp32."""
    return tl.load(V + b * s_b + cols, mask=cm, other=0.0).to(tl.float32)


@jit_sizes
def _fwd(X, Y, GATE, SHIFT, SCALE, X1, H, MEAN, RSTD, N, C, s_gate, s_shift, s_scale, eps, GATED: tl.constexpr,
         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rb, b = pid64(0), pid64(1)
    tok, rm, cols, cm, offs, m = _row_tile(b, rb * BLOCK_R, N, C, BLOCK_R, BLOCK_C)
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    if GATED:  # x1 = x + gate y, normalised as stored (in X1's dtype)
        y = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32)
        x1 = (x + _vec(GATE, b, s_gate, cols, cm)[None, :] * y).to(X1.dtype.element_ty)
        tl.store(X1 + offs, x1, mask=m)
        x = x1.to(tl.float32)
    mean = tl.sum(x, axis=1) / C
    xc = tl.where(m, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / C + eps)
    shift = _vec(SHIFT, b, s_shift, cols, cm)
    scale = _vec(SCALE, b, s_scale, cols, cm)
    h = xc * rstd[:, None] * (1.0 + scale[None, :]) + shift[None, :]
    tl.store(H + offs, h.to(H.dtype.element_ty), mask=m)
    tl.store(MEAN + tok, mean, mask=rm)
    tl.store(RSTD + tok, rstd, mask=rm)


@jit_sizes
def _gate_fwd(X, Y, GATE, OUT, N, C, s_gate, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rb, b = pid64(0), pid64(1)
    tok, rm, cols, cm, offs, m = _row_tile(b, rb * BLOCK_R, N, C, BLOCK_R, BLOCK_C)
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32)
    out = x + _vec(GATE, b, s_gate, cols, cm)[None, :] * y
    tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _grad_offs(b, tok, cols, N, s_b, s_n, s_c):
    """Offsets of an incoming (B, N, C) gradient of any strides (``.sum().backward()`` hands an expanded one)."""
    rows = tok - b * N
    return b * s_b + rows[:, None] * s_n + cols[None, :] * s_c


@jit_sizes(also=("s_ghb", "s_gxb"))
def _bwd(GH, GX1, X, Y, GATE, SCALE, MEAN, RSTD, DX, DY, PART, N, C, s_gate, s_scale, s_ghb, s_ghn, s_ghc, s_gxb,
         s_gxn, s_gxc, n_tiles, n_chunks, HAS_GH: tl.constexpr, HAS_GX1: tl.constexpr, GATED: tl.constexpr,
         K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    chunk, b = pid64(0), pid64(1)
    cols = tl.arange(0, BLOCK_C)
    cm = cols < C
    one_plus_scale = 1.0 + _vec(SCALE, b, s_scale, cols, cm)
    gate = _vec(GATE, b, s_gate, cols, cm) if GATED else one_plus_scale
    sum_gh = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sum_ghx = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sum_dy = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for i in range(n_tiles):
        tok, rm, cols, cm, offs, m = _row_tile(b, (chunk * n_tiles + i) * BLOCK_R, N, C, BLOCK_R, BLOCK_C)
        d = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        if HAS_GH:
            x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + tok, mask=rm, other=0.0)
            rstd = tl.load(RSTD + tok, mask=rm, other=0.0)
            xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
            gh = tl.load(GH + _grad_offs(b, tok, cols, N, s_ghb, s_ghn, s_ghc), mask=m, other=0.0)
            gh = gh.to(tl.float32)
            sum_gh += tl.sum(gh, axis=0)
            sum_ghx += tl.sum(gh * xhat, axis=0)
            g = gh * one_plus_scale[None, :]
            mg = tl.sum(g, axis=1) / C
            mgx = tl.sum(g * xhat, axis=1) / C
            d = tl.where(m, rstd[:, None] * (g - mg[:, None] - xhat * mgx[:, None]), 0.0)
        if HAS_GX1:
            gx1 = tl.load(GX1 + _grad_offs(b, tok, cols, N, s_gxb, s_gxn, s_gxc), mask=m, other=0.0)
            d += gx1.to(tl.float32)
        tl.store(DX + offs, d.to(DX.dtype.element_ty), mask=m)
        if GATED:
            y = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(DY + offs, (d * gate[None, :]).to(DY.dtype.element_ty), mask=m)
            sum_dy += tl.sum(d * y, axis=0)
    dst = PART + (b * n_chunks + chunk) * K * C + cols
    tl.store(dst, sum_gh, mask=cm)
    tl.store(dst + C, sum_ghx, mask=cm)
    if GATED:
        tl.store(dst + 2 * C, sum_dy, mask=cm)


@jit_sizes
def _reduce(PART, D0, D1, D2, n_chunks, C, K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """D_k[b] = sum over the chunks of partial row k (fixed order), in D_k's dtype; D0, D1, D2: contiguous (B, C)."""
    cb, b, k = pid64(0), pid64(1), pid64(2)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, n_chunks, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P).to(tl.int64)
        src = PART + ((b * n_chunks + p[:, None]) * K + k) * C + cols[None, :]
        acc += tl.sum(tl.load(src, mask=(p[:, None] < n_chunks) & cm[None, :], other=0.0), axis=0)
    offs = b * C + cols
    if k == 0:
        tl.store(D0 + offs, acc.to(D0.dtype.element_ty), mask=cm)
    elif k == 1:
        tl.store(D1 + offs, acc.to(D1.dtype.element_ty), mask=cm)
    else:
        tl.store(D2 + offs, acc.to(D2.dtype.element_ty), mask=cm)


@jit_sizes(also=("s_gb",))
def _gate_bwd(G, Y, GATE, DY, DGATE, N, C, s_gate, s_gb, s_gn, s_gc, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b, cb = pid64(0), pid64(1)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    gate = _vec(GATE, b, s_gate, cols, cm)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, N, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        m = (rows < N)[:, None] & cm[None, :]
        offs = (b * N + rows)[:, None] * C + cols[None, :]
        g = tl.load(G + _grad_offs(b, b * N + rows, cols, N, s_gb, s_gn, s_gc), mask=m, other=0.0).to(tl.float32)
        y = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(DY + offs, (g * gate[None, :]).to(DY.dtype.element_ty), mask=m)
        acc += tl.sum(g * y, axis=0)
    tl.store(DGATE + b * C + cols, acc.to(DGATE.dtype.element_ty), mask=cm)


# ------------------------------------------------------------------------------------------------ launchers
def _vec_arg(v: torch.Tensor) -> torch.Tensor:
    """A (B, C) vector as the kernels read it: channel stride 1 (a DiT's modulation chunks are), any batch stride."""
    return v if v.stride(1) == 1 or v.shape[1] == 1 else v.contiguous()


def _check_batch(b: int) -> None:
    if b > MAX_GRID_Y:  # the samples are the grid's second axis
        raise ValueError(f"adaln: batch {b} is above the kernels' {MAX_GRID_Y} samples per launch; split the batch "
                         f"or use backend='torch'")


def _stats(x: torch.Tensor):
    b, n, _ = x.shape
    return (torch.empty(b, n, device=x.device, dtype=torch.float32),
            torch.empty(b, n, device=x.device, dtype=torch.float32))


def _fwd_launch(x, y, gate, shift, scale, x1, h, eps):
    b, n, c = x.shape
    _check_batch(b)
    mean, rstd = _stats(x)
    block_r, block_c, warps = row_cfg(c)
    gated = y is not None
    gate = _vec_arg(gate) if gated else shift
    _fwd[(triton.cdiv(n, block_r), b)](x, y if gated else x, gate, shift, scale, x1 if gated else h, h, mean, rstd,
                                       n, c, gate.stride(0), shift.stride(0), scale.stride(0), float(eps),
                                       GATED=gated, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return mean, rstd


def modulate_norm_fwd_triton(x, shift, scale, eps):
    x, shift, scale = x.contiguous(), _vec_arg(shift), _vec_arg(scale)
    h = torch.empty(x.shape, device=x.device, dtype=out_dtype(x, shift, scale))
    mean, rstd = _fwd_launch(x, None, None, shift, scale, None, h, eps)
    return h, mean, rstd


def gate_residual_modulate_norm_fwd_triton(x, y, gate, shift, scale, eps):
    x, y, shift, scale = x.contiguous(), y.contiguous(), _vec_arg(shift), _vec_arg(scale)
    x1_dtype = out_dtype(x, y, gate)
    x1 = torch.empty(x.shape, device=x.device, dtype=x1_dtype)
    h = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x1_dtype, out_dtype(shift, scale)))
    mean, rstd = _fwd_launch(x, y, gate, shift, scale, x1, h, eps)
    return x1, h, mean, rstd


def gate_residual_fwd_triton(x, y, gate):
    x, y, gate = x.contiguous(), y.contiguous(), _vec_arg(gate)
    b, n, c = x.shape
    _check_batch(b)
    out = torch.empty(x.shape, device=x.device, dtype=out_dtype(x, y, gate))
    block_r, block_c, warps = row_cfg(c)
    _gate_fwd[(triton.cdiv(n, block_r), b)](x, y, gate, out, n, c, gate.stride(0), BLOCK_R=block_r,
                                            BLOCK_C=block_c, num_warps=warps)
    return out


def bwd_chunks(b: int, n: int, block_r: int) -> Tuple[int, int]:
    """(row tiles per program, chunks per sample): about TARGET_PROGRAMS programs, at most one per row tile."""
    n_row_tiles = triton.cdiv(n, block_r)
    n_chunks = max(1, min(n_row_tiles, TARGET_PROGRAMS // max(1, b)))
    n_tiles = triton.cdiv(n_row_tiles, n_chunks)
    return n_tiles, triton.cdiv(n_row_tiles, n_tiles)


def _bwd_launch(gh: Optional[torch.Tensor], gx1: Optional[torch.Tensor], x, y, gate, scale, mean, rstd, dx, dy,
                vec_grads):
    """Kernel 1 (dx, dy, partial column sums) and the reduction into ``vec_grads`` (dshift, dscale[, dgate])."""
    b, n, c = x.shape
    _check_batch(b)
    block_r, block_c, warps = row_cfg(c)
    n_tiles, n_chunks = bwd_chunks(b, n, block_r)
    gated = y is not None
    k = 3 if gated else 2
    part = torch.empty(b * n_chunks, k, c, device=x.device, dtype=torch.float32)
    gate = gate if gated else scale
    has_gh, has_gx1 = gh is not None, gx1 is not None
    any_g = gh if has_gh else gx1  # an absent gradient is not read (HAS_GH / HAS_GX1)
    gh, gx1 = (gh if has_gh else any_g), (gx1 if has_gx1 else any_g)
    _bwd[(n_chunks, b)](gh, gx1, x, y if gated else x, gate, scale, mean, rstd, dx, dy if gated else dx, part, n, c,
                        gate.stride(0), scale.stride(0), *gh.stride(), *gx1.stride(), n_tiles, n_chunks,
                        HAS_GH=has_gh, HAS_GX1=has_gx1, GATED=gated, K=k,
                        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    d0, d1, *rest = vec_grads
    _reduce[(triton.cdiv(c, RED_BLOCK_C), b, k)](part, d0, d1, rest[0] if rest else d1, n_chunks, c, K=k,
                                                 BLOCK_P=BLOCK_P, BLOCK_C=RED_BLOCK_C)


def _new_vec(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(like.shape, device=like.device, dtype=dtype)


def modulate_norm_bwd_triton(dh, x, mean, rstd, scale, shift_dtype):
    x, scale = x.contiguous(), _vec_arg(scale)
    dx = torch.empty_like(x)
    dshift, dscale = _new_vec(scale, shift_dtype), _new_vec(scale, scale.dtype)
    _bwd_launch(dh, None, x, None, None, scale, mean, rstd, dx, None, (dshift, dscale))
    return dx, dshift, dscale


def gate_residual_modulate_norm_bwd_triton(g_x1, g_h, x1, y, gate, mean, rstd, scale, x_dtype, shift_dtype):
    x1, y, gate, scale = x1.contiguous(), y.contiguous(), _vec_arg(gate), _vec_arg(scale)
    dx = torch.empty(x1.shape, device=x1.device, dtype=x_dtype)
    dy = torch.empty_like(y)
    dgate, dshift, dscale = _new_vec(gate, gate.dtype), _new_vec(scale, shift_dtype), _new_vec(scale, scale.dtype)
    _bwd_launch(g_h, g_x1, x1, y, gate, scale, mean, rstd, dx, dy, (dshift, dscale, dgate))
    return dx, dy, dgate, dshift, dscale


def gate_residual_bwd_triton(g, y, gate):
    y, gate = y.contiguous(), _vec_arg(gate)
    b, n, c = y.shape
    dy = torch.empty_like(y)
    dgate = _new_vec(gate, gate.dtype)
    block_c = min(GATE_BLOCK_C, max(16, triton.next_power_of_2(c)))
    _gate_bwd[(b, triton.cdiv(c, block_c))](g, y, gate, dy, dgate, n, c, gate.stride(0), *g.stride(),
                                            BLOCK_T=GATE_BLOCK_T, BLOCK_C=block_c)
    return dy, dgate
