"""Vision-TTT's two gates in Triton, the eager Triton path of its block (fp32 arithmetic whatever the input dtype;
outputs in the input's dtype):

- ``gelu_gate``: the mixer's output gate ``GELU_tanh(u_g) * LayerNorm(z)`` (the input of ``o_proj``, over the C
  channels of a token), one launch forward and one backward (+ one reduction of the LayerNorm weight and bias
  gradients, per-program partial sums: no atomics, deterministic); ``gelu_gate_vjp`` also writes the output, for
  the recompute of ``o_proj``'s input.  PyTorch form: ``TTTLinearMixer._gate``.
- ``silu_mul``: the SwiGLU MLP's ``silu(gate) * value`` with ``[gate, value] = h.chunk(2, -1)``, one launch forward
  and one backward that writes both halves of dh (no ``cat``); ``silu_mul_vjp`` also writes the output, for the
  MLP's recompute (``layers.recompute``).  PyTorch form: ``models.visionttt.SwiGluMlp._mid``.
"""
from typing import List, Tuple

import torch
import triton
import triton.language as tl

from ..triton_utils import pid64

__all__ = ["gelu_gate", "gelu_gate_vjp", "silu_mul", "silu_mul_vjp"]


@triton.jit
def _gelu_tanh(u):
    """GELU_tanh(u) and the tanh inside it (tanh from exp: saturates to +-1 without overflow)."""
    y = 0.7978845608028654 * (u + 0.044715 * u * u * u)
    t = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)
    return 0.5 * u * (1.0 + t), t


@triton.jit
def _rows_in(U, Z, W, B, pid, R, su, C, eps, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's rows: u (fp32), the LayerNorm's xh and 1 / std, its weight and bias, offsets and masks."""
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    cm = cols < C
    m = (rows < R)[:, None] & cm[None, :]
    z = tl.load(Z + rows[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * su + cols[None, :], mask=m, other=0.0).to(tl.float32)
    zc = tl.where(m, z - (tl.sum(z, 1) / C)[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(zc * zc, 1) / C + eps)
    w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cm, other=0.0).to(tl.float32)
    return u, zc * rstd[:, None], rstd, w, b, rows, cols, cm, m


@triton.jit(do_not_specialize=["R", "su"])
def _gate_fwd(U, Z, W, B, Y, R, su, C, eps, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    u, xh, rstd, w, b, rows, cols, cm, m = _rows_in(U, Z, W, B, pid64(0), R, su, C, eps, BLOCK_R, BLOCK_C)
    g, _ = _gelu_tanh(u)
    tl.store(Y + rows[:, None] * C + cols[None, :], g * (xh * w[None, :] + b[None, :]), mask=m)


@triton.jit(do_not_specialize=["R", "su", "sy"])
def _gate_bwd(DY, U, Z, W, B, DU, DZ, P, Y, R, su, sy, C, eps, WRITE_Y: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_C: tl.constexpr):
    pid = pid64(0)
    u, xh, rstd, w, b, rows, cols, cm, m = _rows_in(U, Z, W, B, pid, R, su, C, eps, BLOCK_R, BLOCK_C)
    dy = tl.load(DY + rows[:, None] * sy + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g, t = _gelu_tanh(u)
    if WRITE_Y:  # the forward's output too (the recomputing o_proj's weight gradient needs it)
        tl.store(Y + rows[:, None] * C + cols[None, :], g * (xh * w[None, :] + b[None, :]), mask=m)
    dgelu = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * u * u)
    tl.store(DU + rows[:, None] * C + cols[None, :], dy * (xh * w[None, :] + b[None, :]) * dgelu, mask=m)
    dn = tl.where(m, dy * g, 0.0)  # d LayerNorm(z)
    tl.store(P + (pid * 2) * C + cols, tl.sum(dn * xh, 0), mask=cm)  # partial d weight, d bias of this program
    tl.store(P + (pid * 2 + 1) * C + cols, tl.sum(dn, 0), mask=cm)
    dxh = dn * w[None, :]
    dz = (dxh - (tl.sum(dxh, 1) / C)[:, None] - xh * (tl.sum(dxh * xh, 1) / C)[:, None]) * rstd[:, None]
    tl.store(DZ + rows[:, None] * C + cols[None, :], dz, mask=m)


def _rows(x: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``x`` (..., C) as rows with one row stride (unit channel stride), copied only if it has none."""
    c = x.shape[-1]
    lead = x.shape[:-1]
    if x.stride(-1) != 1 or any(x.stride(i) != x.stride(i + 1) * lead[i + 1] for i in range(len(lead) - 1)):
        x = x.contiguous()
    return x, (x.stride(-2) if x.dim() > 1 else c)


def _cfg(c: int, rows: int) -> Tuple[int, int, int]:
    block_c = triton.next_power_of_2(c)
    block_r = max(1, min(16, 4096 // block_c))
    return block_r, block_c, triton.cdiv(rows, block_r)


def _gate_rows(u: torch.Tensor, z: torch.Tensor):
    """The gate's operands as rows: (u, its row stride, z contiguous, C, rows, the launch config)."""
    u, su = _rows(u)
    z = z.contiguous()
    c = z.shape[-1]
    r = z.numel() // c
    return u, su, z, c, r, _cfg(c, r)


class _GeluGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, z, weight, bias, eps: float):
        u, su, z, c, r, (block_r, block_c, grid) = _gate_rows(u, z)
        y = torch.empty(z.shape, device=z.device, dtype=u.dtype)
        _gate_fwd[(grid,)](u, z, weight, bias, y, r, su, c, eps, BLOCK_R=block_r, BLOCK_C=block_c)
        ctx.save_for_backward(u, z, weight, bias)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        u, z, weight, bias = ctx.saved_tensors
        _, du, dz, dw, db = _gate_vjp(dy, u, z, weight, bias, ctx.eps, False)
        return du, dz, dw, db, None


def _gate_vjp(dy, u, z, weight, bias, eps: float, write_y: bool):
    """(output if ``write_y`` else None, du, dz, d weight, d bias) of the gate for output gradient ``dy``."""
    dy, sy = _rows(dy)
    u, su, z, c, r, (block_r, block_c, grid) = _gate_rows(u, z)
    du = torch.empty(z.shape, device=z.device, dtype=u.dtype)
    dz = torch.empty_like(z)
    y = torch.empty(z.shape, device=z.device, dtype=u.dtype) if write_y else None
    part = torch.empty(grid, 2, c, device=z.device, dtype=torch.float32)
    _gate_bwd[(grid,)](dy, u, z, weight, bias, du, dz, part, du if y is None else y, r, su, sy, c, eps,
                       WRITE_Y=write_y, BLOCK_R=block_r, BLOCK_C=block_c)
    dwb = part.sum(0).to(weight.dtype)
    return y, du, dz, dwb[0], dwb[1]


def gelu_gate_vjp(u: torch.Tensor, dy: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """:func:`gelu_gate`'s output and gradients for output gradient ``dy`` from one launch (+ the weight and bias
    reduction): the ``mid_vjp`` of ``layers.recompute.linear_of_recomputed`` (output, du, [dz, d weight, d bias])."""
    y, du, dz, dw, db = _gate_vjp(dy, u, z, weight.contiguous(), bias.contiguous(), float(eps), True)
    return y, du, [dz, dw, db]


def gelu_gate(u: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``GELU_tanh(u) * layer_norm(z, weight, bias, eps)`` over the last dim of u, z (..., C), in Triton."""
    if u.shape != z.shape or weight.shape != (z.shape[-1],) or bias.shape != weight.shape:
        raise ValueError(f"gelu_gate: u, z must share a (..., C) shape and weight, bias be (C,); got {tuple(u.shape)},"
                         f" {tuple(z.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")
    return _GeluGate.apply(u, z, weight.contiguous(), bias.contiguous(), float(eps))


@triton.jit
def _swiglu_tile(H, R, sh, HID, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's (rows x hidden columns) tile: gate and value (fp32), sigmoid(gate), rows, cols, mask."""
    rows = pid64(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid64(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < R)[:, None] & (cols < HID)[None, :]
    at = H + rows[:, None] * sh + cols[None, :]
    a = tl.load(at, mask=m, other=0.0).to(tl.float32)
    b = tl.load(at + HID, mask=m, other=0.0).to(tl.float32)
    return a, b, tl.sigmoid(a), rows, cols, m


@triton.jit(do_not_specialize=["R", "sh"])
def _swiglu_fwd(H, G, R, sh, HID, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    a, b, s, rows, cols, m = _swiglu_tile(H, R, sh, HID, BLOCK_R, BLOCK_C)
    tl.store(G + rows[:, None] * HID + cols[None, :], a * s * b, mask=m)


@triton.jit(do_not_specialize=["R", "sh", "sg"])
def _swiglu_bwd(DG, H, G, DH, R, sh, sg, HID, WRITE_G: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    a, b, s, rows, cols, m = _swiglu_tile(H, R, sh, HID, BLOCK_R, BLOCK_C)
    dg = tl.load(DG + rows[:, None] * sg + cols[None, :], mask=m, other=0.0).to(tl.float32)
    silu = a * s
    if WRITE_G:
        tl.store(G + rows[:, None] * HID + cols[None, :], silu * b, mask=m)
    at = DH + rows[:, None] * (2 * HID) + cols[None, :]
    tl.store(at, dg * b * s * (1.0 + a * (1.0 - s)), mask=m)  # d gate: silu'(a) = s (1 + a (1 - s))
    tl.store(at + HID, dg * silu, mask=m)  # d value


def _swiglu_grid(rows: int, hid: int) -> Tuple[int, int, Tuple[int, int]]:
    # 2048 elements a program at 4 warps: 16 a thread (4096 spilled 140-232 B in the backward on sm_90)
    block_c = min(128, triton.next_power_of_2(hid))
    block_r = max(1, 2048 // block_c)
    return block_r, block_c, (triton.cdiv(rows, block_r), triton.cdiv(hid, block_c))


def _swiglu_in(h: torch.Tensor) -> Tuple[torch.Tensor, int, int, int]:
    if h.shape[-1] % 2:
        raise ValueError(f"silu_mul: the last dim of h holds [gate, value] and must be even; got {tuple(h.shape)}")
    h, sh = _rows(h)
    hid = h.shape[-1] // 2
    return h, sh, hid, h.numel() // (2 * hid) if hid else 0


def _swiglu_vjp(h: torch.Tensor, dg: torch.Tensor, write_g: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    h, sh, hid, r = _swiglu_in(h)
    dg, sg = _rows(dg)
    g = torch.empty(*h.shape[:-1], hid, device=h.device, dtype=h.dtype) if write_g else h
    dh = torch.empty(h.shape, device=h.device, dtype=h.dtype)
    if r and hid:
        block_r, block_c, grid = _swiglu_grid(r, hid)
        _swiglu_bwd[grid](dg, h, g, dh, r, sh, sg, hid, WRITE_G=write_g, BLOCK_R=block_r, BLOCK_C=block_c)
    return g, dh


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        h, sh, hid, r = _swiglu_in(h)
        g = torch.empty(*h.shape[:-1], hid, device=h.device, dtype=h.dtype)
        if r and hid:
            block_r, block_c, grid = _swiglu_grid(r, hid)
            _swiglu_fwd[grid](h, g, r, sh, hid, BLOCK_R=block_r, BLOCK_C=block_c)
        ctx.save_for_backward(h)
        return g

    @staticmethod
    def backward(ctx, dg):
        (h,) = ctx.saved_tensors
        return _swiglu_vjp(h, dg, False)[1]


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * value`` for ``[gate, value] = h.chunk(2, -1)``, in Triton (autograd: one backward launch)."""
    return _SiluMul.apply(h)


def silu_mul_vjp(h: torch.Tensor, dg: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """:func:`silu_mul`'s output and the gradient of ``h`` for output gradient ``dg``, from one launch: the
    ``mid_vjp`` of ``layers.recompute.linear_of_recomputed`` (output, dh, no parameter gradients)."""
    g, dh = _swiglu_vjp(h, dg, True)
    return g, dh, []
