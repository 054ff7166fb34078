"""Plain softmax self-attention behind the mixer interface (the baseline the TTT mixers replace)."""

from typing import Tuple

import torch
import torch.nn.functional as F

from .mixer import TTTMixer, register_mixer

__all__ = ["SoftmaxAttention"]


@register_mixer("softmax")
class SoftmaxAttention(TTTMixer):
    """Multi-head softmax attention over all tokens; keys ``qkv``, ``proj`` as in timm's ``Attention`` / DiT.

    It has no TTT parameters; ``feat_size`` is accepted for the interface and unused.
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, proj_drop: float = 0.0):
        super().__init__()
        self._init_heads(dim, num_heads)
        self._init_projections(dim, qkv_bias, proj_drop)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))

    def linear_attention_unsupported(self) -> str:
        return "softmax attention is not a linear attention (its exp kernel has no finite feature map)"

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}"
