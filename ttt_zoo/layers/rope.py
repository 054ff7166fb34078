"""2-D rotary position embedding of H-ViT3, computed for the actual feature-map size."""

from typing import Optional, Tuple

import torch

__all__ = ["rope_2d_tables", "apply_rope_2d"]


def rope_2d_tables(feat_size: Tuple[int, int], dim: int, base: float = 10000.0,
                   device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (H, W, dim // 2), built in float32 as the official code does.

    Channel pairs (2p, 2p+1) are complex numbers; pair p < dim/4 turns by row * theta_p,
    pair p >= dim/4 by col * theta_{p - dim/4}, theta_k = base^(-k / (dim/4)).
    """
    if dim % 4:
        raise ValueError(f"2-D RoPE needs a channel count divisible by 4, got {dim}")
    h, w = feat_size
    k_max = dim // 4
    theta = 1.0 / torch.pow(base, torch.arange(0, k_max, device=device, dtype=torch.float32) / k_max)
    rows = torch.arange(0, h, device=device, dtype=torch.float32).view(h, 1, 1).expand(h, w, 1)
    cols = torch.arange(0, w, device=device, dtype=torch.float32).view(1, w, 1).expand(h, w, 1)
    angles = torch.cat([rows * theta, cols * theta], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: (B, H, W, C)``; computed in at least float32 and returned in ``x``'s dtype."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xr = x.to(dt).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    re, im = xr[..., 0], xr[..., 1]
    cos, sin = cos.to(dt), sin.to(dt)
    out = torch.stack([re * cos - im * sin, im * cos + re * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)
