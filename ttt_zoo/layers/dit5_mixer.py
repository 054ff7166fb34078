"""DiT5 mixer: half test-time training, half 2-D neighbourhood attention, on a shared qkv projection.

"Linearizing Vision Transformer with Test-Time Training" (T5 / DiT5, arXiv 2605.02772), class ``MixedAttention``
of the official ``DiT5/models.py``.  Official keys: ``w1, w2, qk_scale_ttt, qk_offset_ttt, qkv, proj, q_conv2d,
k_conv2d``; ``qkv`` and ``proj`` have the shapes of softmax attention, so they are inherited when linearising.
"""

from typing import Optional, Tuple

import torch
from torch import nn
from timm.layers import trunc_normal_

from ttt_zoo.kernels import key_instance_norm, mlp_ttt
from .block import map_to_tokens, tokens_to_map
from .mixer import TTTMixer, register_mixer
from .neighborhood import neighborhood_attention_2d

__all__ = ["DiT5MixedAttention"]


@register_mixer("dit5_mixed")
class DiT5MixedAttention(TTTMixer):
    """out = proj(0.5 * NA(q, k, v) + 0.5 * TTT(q, k, v)).

    TTT path: per-channel affine on q and k (``qk_scale_ttt``/``qk_offset_ttt``, (1, 1, C, 2), [..., 0] for q),
    key instance-norm over the tokens (eps 1.0, no affine), residual depthwise 3x3 convs on q and k, then one
    inner step of a per-head 2-layer SiLU MLP (``w1``, ``w2``) on the regression loss with scale d^-0.5 (raw v).
    NA path: neighbourhood attention on the raw q, k, v (``kernel_size`` 5, natten's border rule).

    Args:
        dim: channels C.
        num_heads: heads (head dim d = C / heads) of both paths.
        qkv_bias: bias of the qkv projection.
        kernel_size, dilation: neighbourhood window (the map must be at least kernel_size * dilation per side).
        use_natten: neighbourhood attention through natten: ``None`` if installed and verified, else PyTorch;
            ``True`` requires it, ``False`` never.
        backend: backend of the TTT ops (``auto`` | ``torch`` | ``torch_naive`` | ``triton``, see
            ``ttt_zoo.kernels.backend``; ``None`` = the process default).
    """
    inner_param_names = ("w1", "w2")

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, kernel_size: int = 5,
                 dilation: int = 1, proj_drop: float = 0.0, use_natten: Optional[bool] = None,
                 backend: Optional[str] = None):
        super().__init__()
        d = self._init_heads(dim, num_heads)
        self.scale = d ** -0.5
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.use_natten: Optional[bool] = use_natten
        self.backend: Optional[str] = backend
        self.w1 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.qk_scale_ttt = nn.Parameter(torch.ones(1, 1, dim, 2))
        self.qk_offset_ttt = nn.Parameter(torch.zeros(1, 1, dim, 2))
        self._init_projections(dim, qkv_bias, proj_drop, qk_convs=True)
        self.reset_inner_parameters()

    def reset_inner_parameters(self) -> None:
        for w in (self.w1, self.w2):
            if w.device.type != "meta":
                trunc_normal_(w, std=0.02)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # B, heads, N, d

    def _ttt(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        s, o = self.qk_scale_ttt, self.qk_offset_ttt
        q = q * s[..., 0] + o[..., 0]
        k = k * s[..., 1] + o[..., 1]
        k = key_instance_norm(k, 1.0, backend=self.backend)  # shared with T5 (ttt_zoo::key_instance_norm)
        q = q + map_to_tokens(self.q_conv2d(tokens_to_map(q, feat_size)))
        k = k + map_to_tokens(self.k_conv2d(tokens_to_map(k, feat_size)))
        out = mlp_ttt(self._heads(q), self._heads(k), self._heads(v), self.w1, self.w2, self.scale,
                      backend=self.backend)
        return out.transpose(1, 2).flatten(2)

    def _na(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        b, n, c = q.shape
        h, w = feat_size
        q = q.reshape(b, h, w, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)
        k = k.reshape(b, h, w, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)
        v = v.reshape(b, h, w, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)
        out = neighborhood_attention_2d(q, k, v, self.kernel_size, self.dilation, self.scale, self.use_natten)
        return out.permute(0, 2, 3, 1, 4).reshape(b, n, c)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = 0.5 * self._na(q, k, v, feat_size) + 0.5 * self._ttt(q, k, v, feat_size)
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, dilation={self.dilation}"
