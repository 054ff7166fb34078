"""Key instance-norm of the T5 and DiT5 mixers: per sample and channel, normalise (B, N, C) over the N tokens.

    y = (x - mean) / sqrt(var + eps),  mean / var (biased) over N, statistics in float32, no affine.

``naive.key_norm_reference`` is the plain form (autograd through it, ``torch_naive``).  ``key_norm_fwd`` /
``key_norm_bwd`` here are the lean path: the forward returns y and the fp32 statistics (mean, rstd), (B, C) each; the backward stores
only x and the statistics and recomputes x^ = (x - mean) rstd:
    dx = rstd (dy - mean_N(dy) - x^ mean_N(dy x^)).
"""
from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["key_norm_fwd", "key_norm_bwd", "key_norm_torch", "check_key_norm", "stat_dtype"]


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_key_norm(x: torch.Tensor, eps: float) -> None:
    if x.dim() != 3:
        raise ValueError(f"key_instance_norm expects (B, N, C) tokens, got shape {tuple(x.shape)}")
    if not eps > 0:
        raise ValueError(f"key_instance_norm eps must be > 0, got {eps}")


def key_norm_fwd(x: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in x's dtype, mean (B, C) fp32, rstd (B, C) fp32)."""
    xf = x.to(stat_dtype(x.dtype))
    mean = xf.mean(dim=1)
    var = (xf - mean[:, None]).square().mean(dim=1)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean[:, None]) * rstd[:, None]
    return (y if y.dtype == x.dtype else y.to(x.dtype)), mean, rstd


def key_norm_bwd(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    dt = stat_dtype(x.dtype)
    xh = (x.to(dt) - mean[:, None]) * rstd[:, None]
    dyf = dy.to(dt)
    dx = rstd[:, None] * (dyf - dyf.mean(dim=1, keepdim=True) - xh * (dyf * xh).mean(dim=1, keepdim=True))
    return dx.to(x.dtype)


def make_function(name: str, fwd, bwd):
    def forward(ctx, x, eps):
        y, mean, rstd = fwd(x, eps)
        ctx.save_for_backward(x, mean, rstd)
        return y

    def backward(ctx, dy):
        return bwd(dy, *ctx.saved_tensors), None

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


KeyNorm = make_function("KeyNorm", key_norm_fwd, key_norm_bwd)


def key_norm_torch(x: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    """Lean PyTorch path: stores x (a view the mixer keeps anyway) and 2 x C fp32 statistics per sample."""
    check_key_norm(x, eps)
    return KeyNorm.apply(x, float(eps))
