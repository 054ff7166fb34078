"""The SD3.5-T5 TTT layer: a diffusers ``Attention`` whose processor runs DiT5's test-time-training step.

"Linearizing Vision Transformer with Test-Time Training" (arXiv 2605.02772) §5.3 / Appendix B: SD3.5-T5 replaces
the image-only self-attention (``attn2``) of the dual-attention MMDiT blocks and the joint text-image attention
(``attn``) of the last blocks by "the same architecture as DiT5 except without NAT": per-channel affine on q and
k, key instance-norm over the tokens, residual 3x3 depthwise convs on q and k (image tokens only), one inner step
of a per-head 2-layer SiLU MLP on the L2 loss (scale d^-0.5).  The math is the zoo's DiT5 ops
(``ttt_zoo.kernels.key_instance_norm`` and ``mlp_ttt``, dispatched by ``kernels/backend.py``), exactly as in
:class:`ttt_zoo.layers.dit5_mixer.DiT5MixedAttention._ttt`.

The module keeps diffusers' ``to_q/to_k/to_v/to_out`` (``add_*_proj``, ``to_add_out``, ``norm_*``) names, so every
pretrained tensor is inherited; the new tensors live under ``.ttt.``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn
from timm.layers import trunc_normal_
from diffusers.models.attention_processor import Attention

from ttt_zoo.kernels import key_instance_norm, mlp_ttt
from ttt_zoo.layers.block import map_to_tokens, tokens_as_map

__all__ = ["KEY_NORM_SPANS", "RMS_QK_NORM_MODES", "SD3TTT", "SD3TTTAttention", "SD3TTTAttnProcessor",
           "TTTProcessorError"]

#: ``joint``: one mean/std per channel over image and text keys together (the TTT layer's whole sequence);
#: ``separate``: image and text keys normalised on their own.
KEY_NORM_SPANS = ("joint", "separate")
#: ``keep``: SD3.5's per-head RMS q/k norms (inherited) run first, then the key instance-norm;
#: ``skip``: the TTT layer bypasses them (the inherited norm weights stay in the checkpoint, unused).
RMS_QK_NORM_MODES = ("keep", "skip")


class TTTProcessorError(ValueError):
    """An attempt to replace the processor of a TTT layer (which would silently turn it back into softmax)."""


class SD3TTT(nn.Module):
    """The TTT-only parameters and math of one SD3.5-T5 layer (DiT5's ``_ttt`` path).

    Parameters (DiT5's, same init): ``w1``, ``w2`` (1, heads, d, d) trunc-normal(.02); ``qk_scale`` / ``qk_offset``
    (1, 1, C, 2; ``[..., 0]`` for q) ones / zeros; ``q_conv2d`` / ``k_conv2d`` depthwise 3x3 (PyTorch default init).
    """

    def __init__(self, dim: int, num_heads: int, key_norm_span: str = "joint", key_norm_eps: float = 1.0,
                 backend: Optional[str] = None):
        super().__init__()
        if key_norm_span not in KEY_NORM_SPANS:
            raise ValueError(f"key_norm_span must be one of {KEY_NORM_SPANS}, got {key_norm_span!r}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.key_norm_span = key_norm_span
        self.key_norm_eps = key_norm_eps
        self.backend = backend
        self.feat_size: Optional[Tuple[int, int]] = None  # (H/p, W/p) of the image tokens, set by the transformer
        self.w1 = nn.Parameter(torch.empty(1, num_heads, self.head_dim, self.head_dim))
        self.w2 = nn.Parameter(torch.empty(1, num_heads, self.head_dim, self.head_dim))
        self.qk_scale = nn.Parameter(torch.empty(1, 1, dim, 2))
        self.qk_offset = nn.Parameter(torch.empty(1, 1, dim, 2))
        self.q_conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.k_conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """DiT5's init of the new parameters (skipped on the meta device; see ``SD3T5Transformer2DModel``)."""
        if self.w1.device.type == "meta":
            return
        for w in (self.w1, self.w2):
            trunc_normal_(w, std=0.02)
        nn.init.ones_(self.qk_scale)
        nn.init.zeros_(self.qk_offset)
        self.q_conv2d.reset_parameters()
        self.k_conv2d.reset_parameters()

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _dwc(self, conv: nn.Conv2d, t: torch.Tensor, n_img: int, feat_size: Tuple[int, int]) -> torch.Tensor:
        """t + DWC(t) on the first ``n_img`` (image) tokens; text tokens pass unchanged (Appendix B)."""
        img = t[:, :n_img]
        img = img + map_to_tokens(conv(tokens_as_map(img, feat_size)))
        return torch.cat([img, t[:, n_img:]], dim=1) if t.shape[1] > n_img else img

    def _key_norm(self, k: torch.Tensor, n_img: int) -> torch.Tensor:
        if self.key_norm_span == "joint" or k.shape[1] == n_img:
            return key_instance_norm(k, self.key_norm_eps, backend=self.backend)
        return torch.cat([key_instance_norm(k[:, :n_img], self.key_norm_eps, backend=self.backend),
                          key_instance_norm(k[:, n_img:], self.key_norm_eps, backend=self.backend)], dim=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_img: int,
                feat_size: Tuple[int, int]) -> torch.Tensor:
        """(B, N, C) q, k, v with the ``n_img`` image tokens first -> (B, N, C)."""
        s, o = self.qk_scale, self.qk_offset
        q = q * s[..., 0] + o[..., 0]
        k = k * s[..., 1] + o[..., 1]
        k = self._key_norm(k, n_img)
        q = self._dwc(self.q_conv2d, q, n_img, feat_size)
        k = self._dwc(self.k_conv2d, k, n_img, feat_size)
        out = mlp_ttt(self._heads(q), self._heads(k), self._heads(v), self.w1, self.w2, self.scale,
                      backend=self.backend)
        return out.transpose(1, 2).flatten(2)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, key_norm_span={self.key_norm_span!r}"


class SD3TTTAttnProcessor:
    """Runs an :class:`SD3TTTAttention`: the softmax processor's projections and q/k norms, then TTT.

    Image-only (``attn2``): ``to_out(TTT(q, k, v))``.  Joint (``attn``): image and text tokens concatenated (image
    first, as ``JointAttnProcessor2_0``), one TTT over both; the outputs split into ``to_out`` / ``to_add_out``.
    """

    def __call__(self, attn: "SD3TTTAttention", hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 feat_size: Optional[Tuple[int, int]] = None, **kwargs):
        if attention_mask is not None:
            raise ValueError("SD3.5-T5 TTT layers take no attention mask (SD3's own processor ignores none either).")
        feat_size = feat_size or attn.ttt.feat_size
        n_img = hidden_states.shape[1]
        if feat_size is None or feat_size[0] * feat_size[1] != n_img:
            raise ValueError(f"The TTT layer needs the latent grid (H/p, W/p) of its {n_img} image tokens, got "
                             f"{feat_size}: run it through SD3T5Transformer2DModel.forward, which sets it.")

        def project(x, lin_q, lin_k, lin_v, norm_q, norm_k):
            q, k, v = lin_q(x), lin_k(x), lin_v(x)
            if attn.rms_qk_norm == "keep":
                b, n, c = q.shape
                if norm_q is not None:
                    q = norm_q(q.view(b, n, attn.heads, -1)).reshape(b, n, c)
                if norm_k is not None:
                    k = norm_k(k.view(b, n, attn.heads, -1)).reshape(b, n, c)
            return q, k, v

        q, k, v = project(hidden_states, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
        if encoder_hidden_states is not None:
            cq, ck, cv = project(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                                 attn.norm_added_q, attn.norm_added_k)
            q, k, v = torch.cat([q, cq], 1), torch.cat([k, ck], 1), torch.cat([v, cv], 1)
        out = attn.ttt(q, k, v, n_img, feat_size).to(q.dtype)
        out, context = out[:, :n_img], out[:, n_img:]
        out = attn.to_out[1](attn.to_out[0](out))
        if encoder_hidden_states is None:
            return out
        if not attn.context_pre_only:
            context = attn.to_add_out(context)
        return out, context


class SD3TTTAttention(Attention):
    """diffusers ``Attention`` (same tensors, same names) + ``.ttt`` (:class:`SD3TTT`), run by
    :class:`SD3TTTAttnProcessor`.  Replacing its processor (``set_attn_processor``, ``fuse_qkv_projections``)
    raises :class:`TTTProcessorError` instead of silently turning the layer back into softmax attention."""

    def __init__(self, *args, key_norm_span: str = "joint", key_norm_eps: float = 1.0, rms_qk_norm: str = "keep",
                 backend: Optional[str] = None, **kwargs):
        if rms_qk_norm not in RMS_QK_NORM_MODES:
            raise ValueError(f"rms_qk_norm must be one of {RMS_QK_NORM_MODES}, got {rms_qk_norm!r}")
        kwargs["processor"] = SD3TTTAttnProcessor()
        super().__init__(*args, **kwargs)
        self.rms_qk_norm = rms_qk_norm
        self.ttt = SD3TTT(self.inner_dim, self.heads, key_norm_span, key_norm_eps, backend)

    def set_processor(self, processor) -> None:
        if not isinstance(processor, SD3TTTAttnProcessor):
            raise TTTProcessorError(
                f"This is an SD3.5-T5 test-time-training layer; setting the processor "
                f"{type(processor).__name__} would silently replace TTT by softmax attention. Set processors only "
                f"on the softmax layers: pass set_attn_processor a dict that keeps the TTT layers' current "
                f"processors (model.attn_processors), or use a softmax SD3Transformer2DModel.")
        super().set_processor(processor)

    def fuse_projections(self, fuse: bool = True) -> None:
        raise TTTProcessorError("fuse_qkv_projections() is not supported on SD3.5-T5 TTT layers: its fused "
                                "processor is softmax attention and would replace the TTT layers.")
