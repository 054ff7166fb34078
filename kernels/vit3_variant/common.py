"""Helpers shared by the reference of the ViT3 inner-loop variants (``naive.py``) and their PyTorch / Triton paths:
the qkv projection split (with the shared q = k layout), TorchScript-compilable."""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..rope import rope_2d

__all__ = ["variant_qkv_split"]


def variant_qkv_split(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], feat_size: Tuple[int, int],
                      heads: int, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], share_qk: bool
                      ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Projection -> SwiGLU-branch (q, k, v) (B, heads, N, d) and conv-branch (q, k, v) (B, d, H, W).

    ``share_qk``: the projection has no query rows (``[k1, v1, k2, v2]``, 2C + 2d outputs) and q is k."""
    b, n, c = x.shape[0], x.shape[1], x.shape[2]
    h, w = feat_size[0], feat_size[1]
    d = c // heads
    y = F.linear(x, weight, bias)
    if share_qk:
        parts = torch.split(y, [c, c, d, d], dim=-1)
        q1, k1, v1, q2, k2, v2 = parts[0], parts[0], parts[1], parts[2], parts[2], parts[3]
    else:
        parts = torch.split(y, [c, c, c, d, d, d], dim=-1)
        q1, k1, v1, q2, k2, v2 = parts[0], parts[1], parts[2], parts[3], parts[4], parts[5]
    if cos is not None and sin is not None:
        k1 = rope_2d(k1.reshape(b, h, w, c), cos, sin).reshape(b, n, c)
        q1 = k1 if share_qk else rope_2d(q1.reshape(b, h, w, c), cos, sin).reshape(b, n, c)
    t1 = [t.reshape(b, n, heads, d).transpose(1, 2) for t in (q1, k1, v1)]
    t2 = [t.transpose(1, 2).reshape(b, d, h, w) for t in (q2, k2, v2)]
    return t1, t2
