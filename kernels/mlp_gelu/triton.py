"""Triton kernel of the MLP's GELU vjp: one elementwise launch reads h and dg and writes gelu(h) and dg gelu'(h)
(fp32 arithmetic; exact erf GELU or its tanh form).  Offsets from ``pid64`` (int64: the hidden activation of a
large batch passes 2^31 elements); the element count is not specialised (``jit_sizes``): one compiled variant per
dtype and form serves every size."""
from typing import Tuple

import torch
import triton
import triton.language as tl

from ..triton_utils import jit_sizes, pid64

__all__ = ["gelu_vjp_triton", "BLOCK", "WARPS"]

BLOCK = 1024  # elements per program (4 per thread at 8 warps: 16-byte fp32 / 8-byte fp16 accesses)
WARPS = 8
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_KAPPA = tl.constexpr(0.044715)


@jit_sizes
def _gelu_vjp(H, DG, G, DH, N, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = pid64(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    h = tl.load(H + offs, mask=m, other=0.0).to(tl.float32)
    dg = tl.load(DG + offs, mask=m, other=0.0).to(tl.float32)
    if TANH:
        u = _SQRT_2_PI * (h + _KAPPA * h * h * h)
        t = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0  # tanh(u), exact at both tails in fp32
        g = 0.5 * h * (1.0 + t)
        dgelu = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _SQRT_2_PI * (1.0 + 3.0 * _KAPPA * h * h)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(h * _SQRT1_2))
        g = h * cdf
        dgelu = cdf + h * _INV_SQRT_2PI * tl.exp(-0.5 * h * h)
    tl.store(G + offs, g.to(G.dtype.element_ty), mask=m)
    tl.store(DH + offs, (dg * dgelu).to(DH.dtype.element_ty), mask=m)


def gelu_vjp_triton(h: torch.Tensor, dg: torch.Tensor, approximate: str) -> Tuple[torch.Tensor, torch.Tensor]:
    h, dg = h.contiguous(), dg.contiguous()
    g, dh = torch.empty_like(h), torch.empty_like(h)
    n = h.numel()
    _gelu_vjp[(triton.cdiv(n, BLOCK),)](h, dg, g, dh, n, TANH=approximate == "tanh", BLOCK=BLOCK, num_warps=WARPS)
    return g, dh
