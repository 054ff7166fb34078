"""Helpers shared by the ViT3 reference (``naive.py``) and the PyTorch / Triton paths: the qkv projection split into
both branches' q, k, v with H-ViT3's RoPE (``kernels/rope.py``), TorchScript-compilable."""

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..backend import tracing
from ..rope import rope_2d
from ..utils import no_autocast

__all__ = ["qkv_split", "backward_inputs", "rope_in_kernels"]


def rope_in_kernels(cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], head_dim: int) -> bool:
    """H-ViT3's RoPE runs inside the fused mixer-core kernels (q, k turned as loaded, dq, dk turned back as stored)
    rather than as aten glue around them: in eager, with whole channel pairs per head; tracers
    (``backend.tracing``) keep the aten form."""
    return cos is not None and sin is not None and head_dim % 2 == 0 and not tracing()


def qkv_split(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], feat_size: Tuple[int, int],
               heads: int, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """qkv projection -> SwiGLU-branch q, k, v (B, heads, N, d) and conv-branch q, k, v (B, d, H, W) views."""
    b, n, c = x.shape[0], x.shape[1], x.shape[2]
    h, w = feat_size[0], feat_size[1]
    d = c // heads
    q1, k1, v1, q2, k2, v2 = torch.split(F.linear(x, weight, bias), [c, c, c, d, d, d], dim=-1)
    if cos is not None and sin is not None:
        q1 = rope_2d(q1.reshape(b, h, w, c), cos, sin).reshape(b, n, c)
        k1 = rope_2d(k1.reshape(b, h, w, c), cos, sin).reshape(b, n, c)
    t1 = [t.reshape(b, n, heads, d).transpose(1, 2) for t in (q1, k1, v1)]
    t2 = [t.transpose(1, 2).reshape(b, d, h, w) for t in (q2, k2, v2)]
    return t1, t2


def backward_inputs(kept: Sequence[torch.Tensor], x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    feat_size: Tuple[int, int], heads: int, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                    amp, pack: Optional[Callable] = None) -> Tuple[torch.Tensor, ...]:
    """The inner steps' inputs (q1, k1, v1, q2, k2, v2) for a mixer-core backward: those the forward ``kept``
    (``recompute=False``), else recomputed from ``x`` (the projection, RoPE and ``pack`` of the conv maps) under the
    forward's autocast state ``amp``, without autograd."""
    if kept:
        return tuple(kept)
    with torch.no_grad(), no_autocast(x.device, *amp):
        (q1, k1, v1), (q2, k2, v2) = qkv_split(x, weight, bias, feat_size, heads, cos, sin)
        if pack is not None:
            q2, k2, v2 = pack(q2, k2, v2)
    return q1, k1, v1, q2, k2, v2
