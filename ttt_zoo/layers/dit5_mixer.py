"""DiT5 mixer: half test-time training, half 2-D neighbourhood attention, on a shared qkv projection.

"Linearizing Vision Transformer with Test-Time Training" (T5 / DiT5, arXiv 2605.02772), class ``MixedAttention``
of the official ``DiT5/models.py``.  Official keys: ``w1, w2, qk_scale_ttt, qk_offset_ttt, qkv, proj, q_conv2d,
k_conv2d``; ``qkv`` and ``proj`` have the shapes of softmax attention, so they are inherited when linearising.
"""

from typing import Optional, Tuple

import torch
from torch import nn
from timm.layers import trunc_normal_

from ttt_zoo.kernels import last_layer_ttt, mlp_ttt
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from ttt_zoo.kernels.backend import TRITON_BACKEND, resolve_backend
from ttt_zoo.kernels.inner_mlp import last_layer_ttt_torch, mlp_inner_update_reference, mlp_ttt_mix, mlp_ttt_op
from ttt_zoo.kernels.key_norm import qkv_fold_op
from ttt_zoo.kernels.utils import compute_dtype
from .mixer import register_mixer
from .neighborhood import neighborhood_attention_2d
from .t5_ttt import PlainStepTTT, blend_na, dit5_form, eager_fold, qkv_inputs, silu_gate_features, stacked_heads

__all__ = ["DiT5MixedAttention"]


@register_mixer("dit5_mixed")
class DiT5MixedAttention(PlainStepTTT):
    """out = proj(0.5 * NA(q, k, v) + 0.5 * TTT(q, k, v)).

    TTT path: per-channel affine on q and k (``qk_scale_ttt``/``qk_offset_ttt``, (1, 1, C, 2), [..., 0] for q),
    key instance-norm over the tokens (eps 1.0, no affine), residual depthwise 3x3 convs on q and k, then one
    inner step of a per-head 2-layer SiLU MLP (``w1``, ``w2``) on the regression loss with scale d^-0.5 (raw v).
    NA path: neighbourhood attention on the raw q, k, v (``kernel_size`` 5, natten's border rule).  On a map side
    shorter than the window the window is clamped to the map (``min(kernel_size, side)``, dilation 1), so that side
    is attended in full, NATTEN's kernel_size == input size case: ``dit5_*_8`` runs at its default 32x32 latent
    (a 4x4 token map).  See :mod:`ttt_zoo.layers.neighborhood`.

    Args:
        dim: channels C.
        num_heads: heads (head dim d = C / heads) of both paths.
        qkv_bias: bias of the qkv projection.
        kernel_size, dilation: neighbourhood window; with dilation 1 it is clamped to a smaller map, with dilation
            > 1 the map must be at least kernel_size * dilation per side.
        use_natten: neighbourhood attention through natten: ``None`` if installed and verified, else PyTorch;
            ``True`` requires it, ``False`` never.
        backend: backend of the TTT ops (``auto`` | ``torch`` | ``torch_naive`` | ``triton``, see
            ``ttt_zoo.kernels.backend``; ``None`` = the process default).

    Variants of "TTT with KV Binding Is Secretly Linear Attention" (Liu et al., Tables 1-2); defaults are DiT5:
        inner_update: ``'all'``; ``'last'`` = Table 2 Variant 1: only w2 learns (w1 stays), so with
            phi(x) = silu(x w1) the step is w2' = w2 - (s/N) phi(k)^T (phi(k) w2 - v), out = phi(q) w2'.
        inner_model: ``None`` (2-layer SiLU MLP); ``'linear'`` = Table 2 Variant 3: one linear layer (only ``w2``
            exists), out = q (w2 - (s/N) k^T (k w2 - v)).
        normalize_grad: DiT5's step is a plain gradient step, so Variant 6 is the baseline: only ``False``.
        gradient_ascent: Table 1: W' = W + grad.  With the regression loss this is descent with v replaced by
            2 f0(k) - v (f0 the initial inner model), not with v negated.
        share_qk: Table 1 "Replace Q with K": the TTT read uses the processed keys; ``qkv`` projects [k, v] only and
            ``q_conv2d`` is dropped; the neighbourhood-attention half takes k as its query too.
        inner_steps: inner gradient steps before the read (Figure 1), settable after construction.  The gradient
            depends on the weights (regression loss), so k steps are *not* k times one step.
    """
    inner_param_names = ("w1", "w2")
    inner_op = "dit5_mlp_ttt"  # as T5TTT.inner_op

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, kernel_size: int = 5,
                 dilation: int = 1, proj_drop: float = 0.0, use_natten: Optional[bool] = None,
                 backend: Optional[str] = None, inner_update: str = "all", inner_model: Optional[str] = None,
                 normalize_grad: bool = False, gradient_ascent: bool = False, share_qk: bool = False,
                 inner_steps: int = 1):
        super().__init__()
        d = self._init_plain_step(dim, num_heads, inner_update, inner_model, normalize_grad, gradient_ascent,
                                  share_qk, inner_steps)
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.use_natten: Optional[bool] = use_natten
        self.backend: Optional[str] = backend
        if not self.linear:
            self.w1 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w2 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.qk_scale_ttt = nn.Parameter(torch.ones(1, 1, dim, 2))
        self.qk_offset_ttt = nn.Parameter(torch.zeros(1, 1, dim, 2))
        self._init_qk_projections(dim, qkv_bias, proj_drop)  # share_qk: [..., 0] of the q/k affine is unused
        self.reset_inner_parameters()

    def reset_inner_parameters(self) -> None:
        for w in ((self.w2,) if self.linear else (self.w1, self.w2)):
            if w.device.type != "meta":
                trunc_normal_(w, std=0.02)

    def _inner(self, q: torch.Tensor, k: Optional[torch.Tensor], v: torch.Tensor,
               na: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The inner step(s) on (k, v), read with q: (B, heads, N, d) each (k None: q stacks q and k, the Triton
        op's form), blended with ``na`` (the forward always passes it; :func:`~ttt_zoo.layers.t5_ttt.blend_na`),
        inside the inner-step op where it has one."""
        scale = -self.scale if self.gradient_ascent else self.scale  # a negative scale flips the update
        if k is None:
            return self._stacked_step(q, v, scale, na)
        if self.linear or self.inner_update == "last":
            if not self.linear:
                q, k = silu_gate_features(q, self.w1, None), silu_gate_features(k, self.w1, None)
            if torch.jit.is_scripting():
                return blend_na(last_layer_ttt_torch(q, k, v, self.w2, scale, "mse", self.inner_steps), na,
                                self.na_weight)
            return blend_na(last_layer_ttt(q, k, v, self.w2, scale, "mse", self.inner_steps, backend=self.backend),
                            na, self.na_weight)
        w1, w2 = self.w1, self.w2
        if self.inner_steps > 1:  # the first k - 1 steps (tiny d x d updates), then the last step + read by the op
            dt = compute_dtype(q.dtype)
            kc, vc = k.to(dt), v.to(dt)
            w1, w2 = w1.to(dt), w2.to(dt)
            for _ in range(self.inner_steps - 1):
                w1, w2 = mlp_inner_update_reference(kc, vc, w1, w2, scale)
            w1, w2 = w1.to(q.dtype), w2.to(q.dtype)
        if na is None:
            return mlp_ttt(q, k, v, w1, w2, scale, backend=self.backend)
        return mlp_ttt_mix(q, k, v, w1, w2, scale, na, self.na_weight, backend=self.backend)

    @torch.jit.unused
    def _stacked_step(self, qk: torch.Tensor, v: torch.Tensor, scale: float,
                      na: Optional[torch.Tensor]) -> torch.Tensor:
        return mlp_ttt_op(qk, None, v, self.w1, self.w2, scale, triton=True, mix=na, mix_weight=self.na_weight)

    def _ttt(self, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             feat_size: Tuple[int, int], na: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, heads, N, d) from the qkv output and its q, k, v views, blended with ``na`` (None: the TTT branch
        alone, as SD3.5-T5's image-only layer runs it); the q and k affines as one launch, the convs' residuals
        folded into their weights."""
        s, o = self.qk_scale_ttt, self.qk_offset_ttt  # (1, 1, C, 2): [..., 0] for q, [..., 1] for k
        if self.share_qk:
            k = torch.addcmul(o[..., 1], k, s[..., 1])
        else:  # [q | k] of the projection as (B, N, C, 2), the parameters' layout
            qk = torch.addcmul(o, qkv[..., :2 * k.shape[-1]].unflatten(-1, (2, k.shape[-1])).transpose(-1, -2), s)
            q, k = qk[..., 0], qk[..., 1]
        q2, k2, _, _ = self._qk_convs(q, k, 1.0, feat_size)  # the key norm shared with T5 (eps 1.0)
        return self._inner(q2, k2, self._heads(v), na)

    def _na(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        """(B, heads, N, d) from (B, N, C) q, k, v (views of the qkv output)."""
        b, n, c = q.shape
        h, w = feat_size
        q = q.reshape(b, h, w, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)
        k = k.reshape(b, h, w, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)
        v = v.reshape(b, h, w, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)
        out = neighborhood_attention_2d(q, k, v, self.kernel_size, self.dilation, self.scale, self.use_natten,
                                        clamp_to_map=True)  # a window larger than the map covers the map
        return out.flatten(2, 3)

    @torch.jit.unused
    def _fused(self, qkv: torch.Tensor, feat_size: Tuple[int, int]) -> Optional[torch.Tensor]:
        """The Triton path from the qkv output: one launch applies the q / k affine, the key norm and both residual
        convs, and writes the copies of q, k, v the attention and the inner step read (``key_norm.qkv_fold_op``; its
        backward launch writes the whole qkv gradient and every parameter's partial sums); then the attention and
        the stacked inner step blended with it.  None where the key norm or the plain inner step does not run
        Triton, or under a tracer."""
        if not eager_fold() or is_fx_symbolic_tracing() or self.share_qk or self.q_conv2d.bias is None or \
                self.k_conv2d.bias is None or not self._stacks_qk(qkv) or \
                resolve_backend(self.backend, qkv.device, qkv.dtype, None, "key_instance_norm") != TRITON_BACKEND:
            return None
        qk, qc, kc, vc, vt = qkv_fold_op(qkv, 1.0, self.qk_scale_ttt, self.qk_offset_ttt, self.q_conv2d.weight,
                                         self.q_conv2d.bias, self.k_conv2d.weight, self.k_conv2d.bias, feat_size,
                                         triton=True)
        return self._inner(stacked_heads(qk, self.num_heads), None, self._heads(vt), self._na(qc, kc, vc, feat_size))

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x)
        fused: Optional[torch.Tensor] = None
        if not torch.jit.is_scripting():
            fused = self._fused(qkv, feat_size)
        if fused is not None:
            x = fused
        else:
            if self.share_qk:
                k, v = qkv.chunk(2, dim=-1)
                q = k
            else:
                q, k, v = qkv.chunk(3, dim=-1)
            # 0.5 (NA + TTT), blended inside the inner-step op; NA's (B, N, heads, d) layout merges the heads free
            x = self._ttt(qkv, q, k, v, feat_size, self._na(q, k, v, feat_size))
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, c)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, dilation={self.dilation}"

    # the exact linear-attention form (every option), written in ttt_zoo.layers.t5_ttt.dit5_form
    def linear_attention_unsupported(self) -> Optional[str]:
        return None

    @torch.jit.unused
    def linear_attention_inputs(self, x: torch.Tensor, feat_size: Tuple[int, int]):
        return qkv_inputs(self, x)

    @torch.jit.unused
    def linear_attention_form_from_inputs(self, t, feat_size: Tuple[int, int]):
        return dit5_form(self, t, feat_size)
