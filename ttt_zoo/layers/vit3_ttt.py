"""ViT3 TTT mixer: a simplified-SwiGLU inner learner over the heads plus one 3x3 depthwise-conv head."""

from typing import Optional, Tuple

import torch
from torch import nn
from timm.layers import register_notrace_function, trunc_normal_

from ttt_zoo.kernels import vit3_qkv_ttt
from .mixer import TTTMixer, register_mixer
from .rope import rope_2d_tables

__all__ = ["ViT3TTT"]

# the ops and RoPE tables are leaves for torch.fx (they branch on devices and shapes)
for _fn in (vit3_qkv_ttt, rope_2d_tables):
    register_notrace_function(_fn)


@register_mixer("vit3")
class ViT3TTT(TTTMixer):
    """One closed-form inner step on (k, v), applied to q; per-sample inner weights.

    Official keys: ``w1, w2`` (1, heads, d, d), ``w3`` (d, 1, 3, 3), ``qkv`` (C -> 3C + 3d), ``proj`` (C + d -> C).

    Args:
        dim: channels C.
        num_heads: heads of the SwiGLU branch (head dim d = C / heads; the conv branch is one extra head of width d).
        qkv_bias: bias of the fused qkv projection.
        scale: inner-loss scale (1/3 = head dim of a 1-channel 3x3 kernel, used by both branches).
        normalize_grad: per-column gradient normalisation g / (||g|| + 1).
        rope: apply H-ViT3's 2-D RoPE to the SwiGLU-branch q and k (computed for the runtime map size).
        backend: backend of the TTT ops (``auto`` | ``torch`` | ``torch_naive`` | ``triton``, see
            ``ttt_zoo.kernels.backend``; ``None`` = the process default, ``TTT_ZOO_BACKEND`` or auto).
    """
    inner_param_names = ("w1", "w2", "w3")

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, scale: float = 1.0 / 3.0,
                 normalize_grad: bool = True, rope: bool = False, rope_base: float = 10000.0,
                 proj_drop: float = 0.0, backend: Optional[str] = None, **kwargs):
        super().__init__()
        d = self._init_heads(dim, num_heads)
        self.scale = scale
        self.normalize_grad = normalize_grad
        self.use_rope = rope
        self.rope_base = rope_base
        self.backend: Optional[str] = backend
        self.w1 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.empty(d, 1, 3, 3))
        self.qkv = nn.Linear(dim, 3 * dim + 3 * d, bias=qkv_bias)
        self.proj = nn.Linear(dim + d, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_inner_parameters()

    def reset_inner_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            if w.device.type != "meta":
                trunc_normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        cos: Optional[torch.Tensor] = None
        sin: Optional[torch.Tensor] = None
        if self.use_rope:
            cos, sin = rope_2d_tables(feat_size, self.dim, self.rope_base, device=x.device)
        # qkv projection + RoPE + both inner steps in one op, whose backward recomputes the projection output
        # instead of storing it (the naive path, backend='torch_naive' and TorchScript, stores everything)
        y = vit3_qkv_ttt(x, self.qkv.weight, self.qkv.bias, self.w1, self.w2, self.w3, feat_size, self.num_heads,
                         self.scale, self.normalize_grad, cos, sin, backend=self.backend)
        return self.proj_drop(self.proj(y))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, scale={self.scale:.4g}, rope={self.use_rope}"
