"""Plain softmax self-attention behind the mixer interface (the baseline the TTT mixers replace)."""

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .mixer import TTTMixer, register_mixer

__all__ = ["SoftmaxAttention"]


@register_mixer("softmax")
class SoftmaxAttention(TTTMixer):
    """Multi-head softmax attention over all tokens; keys ``qkv``, ``proj`` as in timm's ``Attention`` / DiT.

    It has no TTT parameters; ``feat_size`` is accepted for the interface and unused.
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}"
