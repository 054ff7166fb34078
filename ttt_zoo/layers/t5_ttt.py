"""T5 TTT mixer ("Linearizing Vision Transformer with Test-Time Training", arXiv 2605.02772) and its T5+ form.

T5 keeps a softmax ViT's ``qkv`` / ``proj`` and replaces softmax attention by one test-time-training step of a
3-matrix SwiGLU inner model on instance-normalised keys, with residual depthwise convs on queries and keys.
T5+ averages that with 2-D neighbourhood attention on the same q, k, v (paper Eq. 15).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from timm.layers import trunc_normal_

from ttt_zoo.kernels import key_instance_norm, t5_swiglu_ttt
from .block import map_to_tokens, tokens_to_map
from .neighborhood import neighborhood_attention_2d
from .mixer import TTTMixer, register_mixer

__all__ = ["T5TTT", "key_instance_norm"]


@register_mixer("t5")
class T5TTT(TTTMixer):
    """T5 mixer: q, k, v = qkv(x); k <- instance-norm(k); q, k += dwconv3x3(q, k); one inner SwiGLU step; proj.

    Official keys, in order: ``w1, w2, w3`` (1, heads, d, d), ``qkv`` (C -> 3C), ``proj`` (C -> C),
    ``q_conv2d``, ``k_conv2d`` (depthwise 3x3 over C channels, with bias).

    Args:
        dim: channels C.
        num_heads: heads (head dim d = C / heads).
        qkv_bias: bias of the fused qkv projection.
        na_kernel: 0 for T5; an odd size (5 in the paper, or 3) for T5+, whose output is
            0.5 * TTT + 0.5 * neighbourhood attention on the raw q, k, v (Eq. 15).
        key_norm_eps: epsilon of the key instance-norm (1.0 in the official code).
        backend: backend of the TTT ops (``auto`` | ``torch`` | ``torch_naive`` | ``triton``, see
            ``ttt_zoo.kernels.backend``; ``None`` = the process default, ``TTT_ZOO_BACKEND`` or auto).
        recompute: when training (grad enabled, not under torch.compile / TorchScript), store only the mixer input
            and recompute qkv, the key norm, the convs and the inner step in the backward (torch.utils.checkpoint);
            the lean inner-step backward then keeps training memory below a softmax ViT's.
    """
    # new relative to a softmax ViT: the inner weights and the q/k convs (the official recipe trains all of
    # them with the larger "new parameter" learning rate, and `linearize` initialises exactly these)
    inner_param_names = ("w1", "w2", "w3", "q_conv2d", "k_conv2d")

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, proj_drop: float = 0.0,
                 na_kernel: int = 0, key_norm_eps: float = 1.0, backend: Optional[str] = None,
                 recompute: bool = True):
        super().__init__()
        d = self._init_heads(dim, num_heads)
        if na_kernel < 0 or (na_kernel and na_kernel % 2 == 0):
            raise ValueError(f"na_kernel must be 0 (no neighbourhood attention) or odd (3, 5, ...), got {na_kernel}")
        self.scale = d ** -0.5
        self.na_kernel = na_kernel
        self.key_norm_eps = key_norm_eps
        self.backend = backend
        self.recompute = recompute
        self.w1 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self._init_projections(dim, qkv_bias, proj_drop, qk_convs=True)
        self.reset_inner_parameters()

    def reset_inner_parameters(self) -> None:
        """Official init of the TTT-only parameters: w1..w3 trunc_normal(.02), q/k convs PyTorch default."""
        if self.w1.device.type == "meta":
            return
        for w in (self.w1, self.w2, self.w3):
            trunc_normal_(w, std=0.02)
        self.q_conv2d.reset_parameters()
        self.k_conv2d.reset_parameters()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _core(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        """Everything between the input and ``proj``: (B, N, C) -> (B, heads, N, d)."""
        b, n, c = x.shape
        q, k, v = torch.split(self.qkv(x), [c, c, c], dim=-1)
        kn = key_instance_norm(k, self.key_norm_eps, backend=self.backend)
        q2 = q + map_to_tokens(self.q_conv2d(tokens_to_map(q, feat_size)))
        k2 = kn + map_to_tokens(self.k_conv2d(tokens_to_map(kn, feat_size)))
        out = t5_swiglu_ttt(self._heads(q2), self._heads(k2), self._heads(v), self.w1, self.w2, self.w3,
                            self.scale, backend=self.backend)
        if self.na_kernel > 0:
            grid = (b, self.num_heads, feat_size[0], feat_size[1], c // self.num_heads)
            na = neighborhood_attention_2d(self._heads(q).reshape(grid), self._heads(k).reshape(grid),
                                           self._heads(v).reshape(grid), self.na_kernel, 1, self.scale)
            out = 0.5 * out + 0.5 * na.flatten(2, 3)
        return out

    @torch.jit.unused
    def _core_recompute(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return checkpoint(self._core, x, feat_size, use_reentrant=False)
        return self._core(x, feat_size)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        b, n, c = x.shape
        if torch.jit.is_scripting():
            out = self._core(x, feat_size)
        else:
            out = self._core_recompute(x, feat_size)
        out = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, na_kernel={self.na_kernel}"
