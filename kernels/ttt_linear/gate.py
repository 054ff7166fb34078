"""Vision-TTT's output gate ``GELU_tanh(u_g) * LayerNorm(z)`` (the input of ``o_proj``, over the C channels of a
token) in one Triton launch forward and one backward (+ one reduction of the LayerNorm weight and bias gradients,
per-program partial sums: no atomics, deterministic).  fp32 arithmetic whatever the input dtype; the output in the
dtype of ``u_g``.  The eager Triton path of ``layers.ttt_linear`` (the PyTorch form: ``TTTLinearMixer._gate``)."""
from typing import Tuple

import torch
import triton
import triton.language as tl

from ..triton_utils import pid64

__all__ = ["gelu_gate"]


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
def _gate_bwd(DY, U, Z, W, B, DU, DZ, P, R, su, sy, C, eps, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = pid64(0)
    u, xh, rstd, w, b, rows, cols, cm, m = _rows_in(U, Z, W, B, pid, R, su, C, eps, BLOCK_R, BLOCK_C)
    dy = tl.load(DY + rows[:, None] * sy + cols[None, :], mask=m, other=0.0).to(tl.float32)
    g, t = _gelu_tanh(u)
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


class _GeluGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, z, weight, bias, eps: float):
        u, su = _rows(u)
        z = z.contiguous()
        c = z.shape[-1]
        r = z.numel() // c
        block_r, block_c, grid = _cfg(c, r)
        y = torch.empty(z.shape, device=z.device, dtype=u.dtype)
        _gate_fwd[(grid,)](u, z, weight, bias, y, r, su, c, eps, BLOCK_R=block_r, BLOCK_C=block_c)
        ctx.save_for_backward(u, z, weight, bias)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        u, z, weight, bias = ctx.saved_tensors
        dy, sy = _rows(dy)
        _, su = _rows(u)
        c = z.shape[-1]
        r = z.numel() // c
        block_r, block_c, grid = _cfg(c, r)
        du = torch.empty(z.shape, device=z.device, dtype=u.dtype)
        dz = torch.empty_like(z)
        part = torch.empty(grid, 2, c, device=z.device, dtype=torch.float32)
        _gate_bwd[(grid,)](dy, u, z, weight, bias, du, dz, part, r, su, sy, c, ctx.eps, BLOCK_R=block_r,
                           BLOCK_C=block_c)
        dwb = part.sum(0).to(weight.dtype)
        return du, dz, dwb[0], dwb[1], None


def gelu_gate(u: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """``GELU_tanh(u) * layer_norm(z, weight, bias, eps)`` over the last dim of u, z (..., C), in Triton."""
    if u.shape != z.shape or weight.shape != (z.shape[-1],) or bias.shape != weight.shape:
        raise ValueError(f"gelu_gate: u, z must share a (..., C) shape and weight, bias be (C,); got {tuple(u.shape)},"
                         f" {tuple(z.shape)}, {tuple(weight.shape)}, {tuple(bias.shape)}")
    return _GeluGate.apply(u, z, weight.contiguous(), bias.contiguous(), float(eps))
