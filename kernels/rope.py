"""The rotary position embeddings of the zoo, one of each kind (TorchScript-compilable):

- 1-D, rotate-half (channel p pairs with p + d/2): Vision-TTT's in-chunk RoPE of the position inside the mini-batch
  (:func:`inner_rope`; :func:`rope_1d_tables` + :func:`rope_1d` at explicit positions, e.g. a reversed scan);
- 2-D, interleaved pairs (2p, 2p + 1) as complex numbers: H-ViT3's RoPE on a (B, H, W, C) map
  (:func:`rope_2d_tables`, :func:`rope_2d`).

A rotation is orthogonal: ``-sin`` turns back (the backward of both).
"""
from typing import Dict, Optional, Tuple

import torch

from .backend import tracing
from .utils import cached_constant, compute_dtype

__all__ = ["rope_1d_tables", "rope_1d", "inner_rope", "rope_2d_tables", "rope_2d"]


def rope_1d_tables(pos: torch.Tensor, d: int, theta: float, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the 1-D RoPE angles at positions ``pos: (N,)``: (N, d / 2) each (built in float64, then cast)."""
    if d % 2:
        raise ValueError(f"1-D RoPE needs an even head dim, got {d}")
    freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float64) / d))
    ang = pos.to(torch.float64)[:, None] * freq[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_1d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotation of ``x: (..., N, d)`` by the tables of :func:`rope_1d_tables`."""
    x1, x2 = x.chunk(2, dim=-1)  # one split: its backward is one cat
    return torch.cat([torch.addcmul(x1 * cos, x2, sin, value=-1.0), torch.addcmul(x2 * cos, x1, sin)], dim=-1)


def inner_rope(x: torch.Tensor, mini_batch: int, theta: float = 10000.0) -> torch.Tensor:
    """1-D RoPE of the position inside the mini-batch (``t mod b``) on ``x: (B, heads, N, d)``.  The table has only
    ``b x d/2`` entries, gathered to the N positions: its size does not depend on N, so a traced graph (TorchScript's
    exporter) holds at every token count."""
    cos, sin = rope_1d_tables(torch.arange(mini_batch, device=x.device, dtype=torch.float64), x.shape[-1], theta,
                              x.dtype)
    pos = torch.arange(x.shape[-2], device=x.device) % mini_batch
    return rope_1d(x, cos[pos], sin[pos])


def _build_rope_2d_tables(h: int, w: int, dim: int, base: float, device: Optional[torch.device]
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    k_max = dim // 4
    theta = 1.0 / torch.pow(base, torch.arange(0, k_max, device=device, dtype=torch.float32) / k_max)
    rows = torch.arange(0, h, device=device, dtype=torch.float32).view(h, 1, 1).expand(h, w, 1)
    cols = torch.arange(0, w, device=device, dtype=torch.float32).view(1, w, 1).expand(h, w, 1)
    angles = torch.cat([rows * theta, cols * theta], dim=-1)
    return angles.cos(), angles.sin()


# eager-only cache of the 2-D tables and their complex turn (utils.cached_constant); plain tensors, not buffers: no
# state-dict key
_ROPE_2D_CACHE: Dict[Tuple[int, int, int, float, str], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _tables_and_turn(h: int, w: int, dim: int, base: float, device: torch.device
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cos, sin = _build_rope_2d_tables(h, w, dim, base, device)
    return cos, sin, torch.complex(cos, sin)


@torch.jit.ignore
def _cached_rope_2d_tables(h: int, w: int, dim: int, base: float, device: Optional[torch.device]
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    dev = torch.device("cpu") if device is None else torch.device(device)
    cos, sin, _ = cached_constant(_ROPE_2D_CACHE, (h, w, dim, float(base), str(dev)),
                                  lambda: _tables_and_turn(h, w, dim, base, dev))
    return cos, sin


def _cached_turn(cos: torch.Tensor, sin: torch.Tensor) -> Optional[torch.Tensor]:
    """The complex turn cos + i sin if (cos, sin) are tables of the cache (then no launch builds it)."""
    for c, s, turn in _ROPE_2D_CACHE.values():
        if c is cos and s is sin:
            return turn
    return None


def rope_2d_tables(feat_size: Tuple[int, int], dim: int, base: float = 10000.0,
                   device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of H-ViT3's 2-D RoPE, (H, W, dim // 2), built in float32 as the official code does.

    Channel pairs (2p, 2p+1) are complex numbers; pair p < dim/4 turns by row * theta_p,
    pair p >= dim/4 by col * theta_{p - dim/4}, theta_k = base^(-k / (dim/4)).
    In eager the tables are cached per (H, W, dim, base, device) (no launch after the first call); TorchScript,
    torch.compile and the exporters build them in the graph.  Treat them as read-only.
    """
    if dim % 4:
        raise ValueError(f"2-D RoPE needs a channel count divisible by 4, got {dim}")
    h, w = feat_size[0], feat_size[1]
    if not torch.jit.is_scripting():
        if not tracing():
            return _cached_rope_2d_tables(h, w, dim, base, device)
    return _build_rope_2d_tables(h, w, dim, base, device)


def rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """H-ViT3's 2-D RoPE on ``x: (B, H, W, C)``, computed in at least float32 and returned in ``x``'s dtype.

    In eager, for channel pairs that can be viewed as complex numbers, one complex multiply (two launches with the
    table instead of nine); the real form under TorchScript, torch.compile and export."""
    dt = compute_dtype(x.dtype)
    if not torch.jit.is_scripting():
        if not tracing():
            xd = x.to(dt)
            if xd.stride(-1) == 1 and xd.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in xd.stride()[:-1]):
                turn = _cached_turn(cos, sin) if dt == torch.float32 else None
                if turn is None:
                    turn = torch.complex(cos.to(dt), sin.to(dt))
                return torch.view_as_real(torch.view_as_complex(xd.unflatten(-1, (-1, 2))) * turn).flatten(-2).to(
                    x.dtype)
    xr = x.to(dt).unflatten(-1, (-1, 2))
    re, im = xr[..., 0], xr[..., 1]
    cos, sin = cos.to(dt), sin.to(dt)
    return torch.stack([re * cos - im * sin, im * cos + re * sin], dim=-1).flatten(-2).to(x.dtype)
