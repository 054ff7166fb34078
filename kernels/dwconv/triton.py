"""Triton kernels of the residual depthwise 3x3 conv ``act(x + b + dwconv3x3(x))`` on (B, N, C) tokens (see
``naive.py``).

Tiles of BLOCK_T tokens x BLOCK_C channels: the channels are contiguous in memory, so each of the nine shifted loads
is a run of BLOCK_C elements per token (vectorised); map positions come from the token index (row = n // W).  A
sample's base offset is int64 (``token_offset``), offsets inside it int32 (N C < 2^31, checked); the image sizes
(N, Hh, Ww) and the chunking are not specialised (``jit_sizes``), so one compiled variant per dtype and channel
block serves every image size.  Arithmetic in fp32.
  ``_fwd``: one launch, one program per (token tile, channel block, sample).
  ``_bwd``: one launch; program (chunk, channel block, sample) walks ``n_tiles`` token tiles and writes
      dx(q) = g'(q) + sum_k w_k g'(q - k)   (g' = dy * act'(pre-activation), recomputed from x at the nine shifts)
  and its partial sums of dW_k = sum_q g'(q - k) x(q) and db = sum_q g'(q) to a (programs, 16, C) fp32 buffer.
  With ``WRITE_Y`` it also writes the forward's output y (the pre-activation at q is computed there anyway): a
  caller that recomputes y for another gradient (``layers.recompute``) saves the forward launch; with ``IN_GELU``
  (x = gelu(h)) dx is multiplied by gelu'(h), the gradient of h (the MLP's fc1 output: no gelu_backward launch).
  ``_reduce``: one launch sums the partials over programs (fixed order: deterministic, no atomics).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..triton_utils import jit_sizes, pid64

__all__ = ["residual_dwconv_fwd_triton", "residual_dwconv_bwd_triton", "launch_cfg", "ACT_CODES"]

BLOCK_T = 32  # tokens per tile
MAX_BLOCK_C = 64  # channels per tile (64 fp16 = 128 bytes a token)
ROWS = 16  # partial rows per program: 9 taps, the bias, padding to a power of two
TARGET_PROGRAMS = 4096  # backward programs aimed at (bounds the partials: TARGET_PROGRAMS x 16 x BLOCK_C fp32)
BLOCK_P = 32  # partial rows summed per step of the reduction
# warps (sm_90 ptxas, experiments/compile_kernels.py): the backward on 8 (4 spilled the GELU backward), the forward on
# 4 (8 spilled 76 B in fp16 without an activation at 80 registers; 4: 102-130 registers, no spills in any dtype)
BWD_WARPS = 8
FWD_WARPS = 4
ACT_CODES = {None: 0, "gelu": 1}
_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def launch_cfg(c: int) -> Tuple[int, int]:
    """(BLOCK_C, channel blocks) for C channels."""
    block_c = min(MAX_BLOCK_C, max(16, triton.next_power_of_2(c)))
    return block_c, triton.cdiv(c, block_c)


@triton.jit
def token_offset(b, tok, N, C):
    """Element offset of token ``tok`` of sample ``b`` in a contiguous (B, N, C) tensor, in int64."""
    return (b.to(tl.int64) * N + tok) * C


@triton.jit
def _preact(Xs, Wt, Bias, row, col, live, offs_c, cm, Hh, Ww, C, HAS_BIAS: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """x + b + sum_k w_k x(shift k) at map positions (row, col) where ``live`` (fp32, zero elsewhere); ``Xs``: the
    sample's first element (its int64 base added once; offsets inside a sample are int32, N C < 2^31)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(9):
        r = row + (k // 3 - 1)
        c = col + (k % 3 - 1)
        m = live & (r >= 0) & (r < Hh) & (c >= 0) & (c < Ww)
        offs = (r * Ww + c) * C
        xv = tl.load(Xs + offs[:, None] + offs_c[None, :], mask=m[:, None] & cm[None, :], other=0.0).to(tl.float32)
        w = tl.load(Wt + offs_c * 9 + k, mask=cm, other=0.0).to(tl.float32)
        acc += xv * w[None, :]
        if k == 4:
            acc += xv  # the residual
    if HAS_BIAS:
        acc += tl.load(Bias + offs_c, mask=cm, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _gelu(y):
    return 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))


@triton.jit
def _gelu_grad(y):
    return 0.5 * (1.0 + tl.erf(y * 0.7071067811865476)) + y * 0.3989422804014327 * tl.exp(-0.5 * y * y)


@jit_sizes
def _fwd(X, Wt, Bias, Y, N, Hh, Ww, C, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t, cb, b = pid64(0), pid64(1), pid64(2)
    tok = (t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int32)  # < N + BLOCK_T: a token index fits int32
    live = tok < N
    row, col = tok // Ww, tok % Ww
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    base = token_offset(b, 0, N, C)
    y = _preact(X + base, Wt, Bias, row, col, live, offs_c, cm, Hh, Ww, C, HAS_BIAS, BLOCK_T, BLOCK_C)
    if ACT == 1:
        y = _gelu(y)
    offs = tok * C
    tl.store(Y + base + offs[:, None] + offs_c[None, :], y.to(Y.dtype.element_ty), mask=live[:, None] & cm[None, :])


@jit_sizes
def _bwd(DY, X, Wt, Bias, DX, PART, Y, HPRE, N, Hh, Ww, C, n_tiles, n_chunks, ACT: tl.constexpr,
         HAS_BIAS: tl.constexpr, WRITE_Y: tl.constexpr, IN_GELU: tl.constexpr, BLOCK_T: tl.constexpr,
         BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
    chunk, cb, b = pid64(0), pid64(1), pid64(2)
    base = token_offset(b, 0, N, C)
    DYs, Xs = DY + base, X + base
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    taps = tl.arange(0, ROWS)
    part = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)  # rows 0-8: dW taps, row 9: db
    for i in range(n_tiles):
        tok = ((chunk * n_tiles + i) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int32)
        live = tok < N
        row, col = tok // Ww, tok % Ww
        offs = tok * C
        tile_m = live[:, None] & cm[None, :]
        x = tl.load(Xs + offs[:, None] + offs_c[None, :], mask=tile_m, other=0.0).to(tl.float32)
        dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        if WRITE_Y and ACT == 0:
            y = _preact(Xs, Wt, Bias, row, col, live, offs_c, cm, Hh, Ww, C, HAS_BIAS, BLOCK_T, BLOCK_C)
            tl.store(Y + base + offs[:, None] + offs_c[None, :], y.to(Y.dtype.element_ty), mask=tile_m)
        for k in range(9):  # not unrolled: one shift's tiles live at a time
            # p = q - shift k: g'(p) reaches dx(q) through tap k, and dW_k through x(q)
            rp = row - (k // 3 - 1)
            cp = col - (k % 3 - 1)
            lp = live & (rp >= 0) & (rp < Hh) & (cp >= 0) & (cp < Ww)
            offs_p = (rp * Ww + cp) * C
            g = tl.load(DYs + offs_p[:, None] + offs_c[None, :], mask=lp[:, None] & cm[None, :],
                        other=0.0).to(tl.float32)
            if ACT == 1:
                pre = _preact(Xs, Wt, Bias, rp, cp, lp, offs_c, cm, Hh, Ww, C, HAS_BIAS, BLOCK_T, BLOCK_C)
                if WRITE_Y:
                    if k == 4:  # p = q: the forward's output, for a caller that recomputes it
                        tl.store(Y + base + offs[:, None] + offs_c[None, :], _gelu(pre).to(Y.dtype.element_ty),
                                 mask=tile_m)
                g = g * _gelu_grad(pre)
            w = tl.load(Wt + offs_c * 9 + k, mask=cm, other=0.0).to(tl.float32)
            dx += g * w[None, :]
            part += tl.where(taps[:, None] == k, tl.sum(g * x, axis=0)[None, :], 0.0)
            if k == 4:
                dx += g
                part += tl.where(taps[:, None] == 9, tl.sum(g, axis=0)[None, :], 0.0)
        if IN_GELU:  # x = gelu(h): the gradient of h
            h = tl.load(HPRE + base + offs[:, None] + offs_c[None, :], mask=tile_m, other=0.0).to(tl.float32)
            dx = dx * _gelu_grad(h)
        tl.store(DX + base + offs[:, None] + offs_c[None, :], dx.to(DX.dtype.element_ty), mask=tile_m)
    prog = b * n_chunks + chunk
    dst = PART + (prog * ROWS + taps[:, None]) * C + offs_c[None, :]
    tl.store(dst, part, mask=(taps[:, None] < 10) & cm[None, :])


@jit_sizes
def _reduce(PART, DW, DB, B, n_chunks, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
    cb, tap = pid64(0), pid64(1)
    n_parts = B * n_chunks
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P).to(tl.int64)
        src = PART + (p[:, None] * ROWS + tap) * C + offs_c[None, :]
        acc += tl.sum(tl.load(src, mask=(p[:, None] < n_parts) & cm[None, :], other=0.0), axis=0)
    if tap < 9:
        tl.store(DW + offs_c * 9 + tap, acc.to(DW.dtype.element_ty), mask=cm)
    else:
        tl.store(DB + offs_c, acc.to(DB.dtype.element_ty), mask=cm)


def _check_size(x: torch.Tensor) -> None:
    if x.shape[1] * x.shape[2] >= 2 ** 31:  # offsets inside a sample are int32 (a sample's base is int64)
        raise ValueError(f"residual_dwconv3x3: one sample of {x.shape[1]} x {x.shape[2]} elements is above the "
                         f"kernels' 2^31; split the map or use backend='torch'")


def residual_dwconv_fwd_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                               feat_size: Tuple[int, int], act: Optional[str]) -> torch.Tensor:
    x = x.contiguous()
    _check_size(x)
    b, n, c = x.shape
    y = torch.empty_like(x)
    block_c, c_blocks = launch_cfg(c)
    w = weight.contiguous()
    _fwd[(triton.cdiv(n, BLOCK_T), c_blocks, b)](x, w, w if bias is None else bias.contiguous(), y, n, feat_size[0],
                                                 feat_size[1], c, ACT=ACT_CODES[act], HAS_BIAS=bias is not None,
                                                 BLOCK_T=BLOCK_T, BLOCK_C=block_c, num_warps=FWD_WARPS)
    return y


def bwd_chunks(b: int, n: int, c_blocks: int) -> Tuple[int, int]:
    """(token tiles per program, chunks per sample): about TARGET_PROGRAMS programs, at most one per token tile."""
    n_tok_tiles = triton.cdiv(n, BLOCK_T)
    n_chunks = max(1, min(n_tok_tiles, TARGET_PROGRAMS // max(1, b * c_blocks)))
    n_tiles = triton.cdiv(n_tok_tiles, n_chunks)
    return n_tiles, triton.cdiv(n_tok_tiles, n_tiles)


def residual_dwconv_bwd_triton(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                               feat_size: Tuple[int, int], act: Optional[str], want_y: bool = False,
                               pre_x: Optional[torch.Tensor] = None):
    """(dx in x's dtype, dweight in weight's dtype, dbias (C,) in weight's dtype, and the forward's output y where
    ``want_y``, else an empty tensor).  ``pre_x``: x = gelu(pre_x), and dx is the gradient of pre_x instead."""
    x, dy = x.contiguous(), dy.contiguous()
    _check_size(x)
    b, n, c = x.shape
    block_c, c_blocks = launch_cfg(c)
    n_tiles, n_chunks = bwd_chunks(b, n, c_blocks)
    dx = torch.empty_like(x)
    y = torch.empty_like(x) if want_y else x.new_empty(0)
    part = torch.empty(b * n_chunks, ROWS, c, device=x.device, dtype=torch.float32)
    w = weight.contiguous()
    bias_arg = w if bias is None else bias.contiguous()
    hpre = x if pre_x is None else pre_x.contiguous()
    _bwd[(n_chunks, c_blocks, b)](dy, x, w, bias_arg, dx, part, y if want_y else dx, hpre, n, feat_size[0],
                                  feat_size[1], c, n_tiles, n_chunks, ACT=ACT_CODES[act], HAS_BIAS=bias is not None,
                                  WRITE_Y=want_y, IN_GELU=pre_x is not None, BLOCK_T=BLOCK_T, BLOCK_C=block_c,
                                  ROWS=ROWS, num_warps=BWD_WARPS)
    dw = torch.empty_like(w)
    db = torch.empty(c, device=x.device, dtype=(weight if bias is None else bias).dtype)
    _reduce[(c_blocks, 10)](part, dw, db, b, n_chunks, c, BLOCK_P=BLOCK_P, BLOCK_C=block_c, ROWS=ROWS)
    return dx, dw, db, y
