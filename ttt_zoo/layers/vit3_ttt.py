"""ViT3 TTT mixer: a simplified-SwiGLU inner learner over the heads plus one 3x3 depthwise-conv head."""

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import register_notrace_function, trunc_normal_

from ttt_zoo.kernels import vit3_qkv_ttt, vit3_variant_qkv_ttt
from . import la_forms as laf
from .block import tokens_to_map
from .mixer import TTTMixer, register_mixer
from .variants import VariantOptions, check_variant_options
from .rope import apply_rope_2d, rope_2d_tables

__all__ = ["ViT3TTT", "variant_state_dict"]

INNER_MODELS = ("swiglu", "linear")

# the ops and RoPE tables are leaves for torch.fx (they branch on devices and shapes)
for _fn in (vit3_qkv_ttt, vit3_variant_qkv_ttt, rope_2d_tables):
    register_notrace_function(_fn)


@register_mixer("vit3")
class ViT3TTT(VariantOptions, TTTMixer):
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
        recompute: in training, the backward recomputes the qkv projection from the stored input instead of
            keeping its (B, N, 3C + 3d) output (the ``recompute`` switch of the T5 mixers; ViT3's own op only).
            ``False``: one GEMM fewer per step, 3.5 C more floats per token stored (an attribute: settable later).

    Inner-loop variants of Liu et al., "Test-Time Training with KV Binding Is Secretly Linear Attention" (the
    defaults are ViT3 itself; any other value runs the ``vit3_variant_qkv_ttt`` op):
        inner_update: ``'all'`` or ``'last'`` (Table 2, Variant 1): only w1 (the last layer) steps; the gate
            silu(x w2) keeps w2 (no gate gradient, no second step).  A static kernel: o = silu(q w2) * (q S).
        inner_model: ``'swiglu'`` or ``'linear'`` (Table 2, Variant 3): one linear inner layer f(x) = x w1 (no
            gate, no ``w2`` parameter): o = q S, S = w1 - N(c k^T v), plain linear attention (two GEMMs per head).
        normalize_grad=False is Table 2's Variant 6 for ViTTT (its footnote: no gradient orthogonalisation, so the
            normalisation is ablated); here it switches off both branches' normalisation (the authors' code keeps
            it in the conv branch).
        gradient_ascent: the inner steps go up the gradient (Table 1, "Gradient Ascent"), in both branches.
        share_qk: queries replaced by keys (Table 1, "Replace Q with K"), in both branches; ``qkv`` then has no
            query rows (C -> 2C + 2d): a baseline checkpoint needs :func:`variant_state_dict`.
        inner_steps: k inner steps on (k, v) (Figure 1; settable later with :meth:`set_inner_steps`).  With a
            loss linear in the stepped weights (``'last'``, ``'linear'``, the conv branch) the gradient does not
            move, so k steps are one step of k N(G); the full SwiGLU loops (reference path, autograd).
    """
    inner_param_names = ("w1", "w2", "w3")

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, scale: float = 1.0 / 3.0,
                 normalize_grad: bool = True, rope: bool = False, rope_base: float = 10000.0,
                 proj_drop: float = 0.0, backend: Optional[str] = None, inner_update: str = "all",
                 inner_model: str = "swiglu", gradient_ascent: bool = False, share_qk: bool = False,
                 inner_steps: int = 1, recompute: bool = True):
        super().__init__()
        d = self._init_heads(dim, num_heads)
        check_variant_options(type(self).__name__, inner_update, inner_model, INNER_MODELS, inner_steps)
        self.scale = scale
        self.normalize_grad = normalize_grad
        self.use_rope = rope
        self.rope_base = rope_base
        self.backend: Optional[str] = backend
        self.recompute = bool(recompute)
        self.inner_update = inner_update
        self.inner_model = inner_model
        self.gradient_ascent = bool(gradient_ascent)
        self.share_qk = bool(share_qk)
        self.inner_steps = inner_steps
        self.w1 = nn.Parameter(torch.empty(1, num_heads, d, d))
        # the single linear inner layer has no gate: no w2 (an unused parameter would break DDP)
        self.w2 = nn.Parameter(torch.empty(1, num_heads, d, d)) if inner_model == "swiglu" else None
        self.w3 = nn.Parameter(torch.empty(d, 1, 3, 3))
        self.qkv = nn.Linear(dim, (2 if share_qk else 3) * (dim + d), bias=qkv_bias)
        self.proj = nn.Linear(dim + d, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_inner_parameters()

    @property
    def is_variant(self) -> bool:
        """Any inner-loop option away from ViT3's own (runs the variant op)."""
        return (self.inner_update != "all" or self.inner_model != "swiglu" or self.gradient_ascent or self.share_qk
                or self.inner_steps != 1)

    def reset_inner_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            if w is not None and w.device.type != "meta":
                trunc_normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        cos: Optional[torch.Tensor] = None
        sin: Optional[torch.Tensor] = None
        if self.use_rope:
            cos, sin = rope_2d_tables(feat_size, self.dim, self.rope_base, device=x.device)
        # qkv projection + RoPE + both inner steps in one op, whose backward recomputes the projection output
        # instead of storing it (the naive path, backend='torch_naive' and TorchScript, stores everything)
        if self.is_variant:
            y = vit3_variant_qkv_ttt(x, self.qkv.weight, self.qkv.bias, self.w1, self.w2, self.w3, feat_size,
                                     self.num_heads, self.scale, self.normalize_grad, cos, sin,
                                     self.inner_update == "last", -1.0 if self.gradient_ascent else 1.0,
                                     self.share_qk, self.inner_steps, backend=self.backend)
        else:
            w2 = self.w2
            assert w2 is not None  # only the linear inner model has none, and it is a variant
            y = vit3_qkv_ttt(x, self.qkv.weight, self.qkv.bias, self.w1, w2, self.w3, feat_size,
                             self.num_heads, self.scale, self.normalize_grad, cos, sin, backend=self.backend,
                             recompute=self.recompute)
        return self.proj_drop(self.proj(y))

    # ---- the exact linear-attention form (every option: V1, V3, V6, ascent, Q := K, k steps)
    def linear_attention_unsupported(self) -> Optional[str]:
        return None

    def linear_attention_inputs(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Dict[str, torch.Tensor]:
        """q, k, v (B, N, C + d): the SwiGLU heads (q, k rotated with RoPE) then the conv head; q is k with
        ``share_qk``."""
        b, n, c = x.shape
        d = self.head_dim
        y = self.qkv(x)
        if self.share_qk:
            k1, v1, k2, v2 = torch.split(y, [c, c, d, d], dim=-1)
            q1, q2 = k1, k2
        else:
            q1, k1, v1, q2, k2, v2 = torch.split(y, [c, c, c, d, d, d], dim=-1)
        if self.use_rope:
            cos, sin = rope_2d_tables(feat_size, c, self.rope_base, device=x.device)
            rot = lambda t: apply_rope_2d(t.reshape(b, feat_size[0], feat_size[1], c), cos, sin).reshape(b, n, c)  # noqa: E731
            k1 = rot(k1)
            q1 = k1 if self.share_qk else rot(q1)
        return dict(q=torch.cat([q1, q2], -1), k=torch.cat([k1, k2], -1), v=torch.cat([v1, v2], -1))

    def linear_attention_form_from_inputs(self, t: Dict[str, torch.Tensor], feat_size: Tuple[int, int]
                                          ) -> laf.ViT3Form:
        """The last inner layer w1 is linear in its steps: ``S = w1 + k^T v_hat`` with one key block per step,
        ``v_hat_t = lr (s/N) v * silu(k w2_t) / ||.||`` (the gate of step t; none for the linear inner model);
        the read gate is ``silu(q w2_final)`` (w2 stepped by autograd of the inner loss, fixed with V1).  The conv
        head's gradient does not depend on w3: k steps are one step of k times the (normalised) update."""
        c, d, h = self.dim, self.head_dim, self.num_heads
        b, n = t["q"].shape[:2]
        q, k, v = (laf.heads(t[s][..., :c], h) for s in "qkv")
        graph = torch.is_grad_enabled() and any(t[s].requires_grad for s in "qkv")
        s = self.scale / n
        lr = -1.0 if self.gradient_ascent else 1.0
        w1 = self.w1.to(q.dtype)
        w2 = None if self.w2 is None else self.w2.to(q.dtype)
        v_hats, coefs = [], []
        for _ in range(self.inner_steps):
            gate_k = torch.ones_like(k) if w2 is None else F.silu(k @ w2)
            coef = s * gate_k  # -dL/dW1 = k^T (coef * v), L = -(s/N) sum <f(k), v>
            norm = laf.col_norm(k.transpose(-2, -1) @ (coef * v), [-2]) if self.normalize_grad else 1.0
            v_hats.append(lr * coef * v / norm)
            coefs.append(lr * coef / norm)
            if w2 is not None and self.inner_update == "all":  # the gate's own step, at the current w1
                w1_now = w1 + sum(k.transpose(-2, -1) @ vh for vh in v_hats[:-1])
                g2, = laf.inner_grads(lambda w, w1n=w1_now: -(s * (k @ w1n) * F.silu(k @ w) * v).sum(), [w2], b,
                                      graph)
                w2 = w2 - lr * (g2 / laf.col_norm(g2, [-2]) if self.normalize_grad else g2)
        kk = k.repeat(1, 1, self.inner_steps, 1)
        gate = torch.ones_like(q) if w2 is None else F.silu(q @ w2)
        swiglu = laf.SwiGLUForm(q, kk, torch.cat(v_hats, 2), w1, gate, torch.cat(coefs, 2))

        def patches(z):  # (B, N, d) tokens -> (B, d, N, 9) zero-padded 3x3 patches, in w3's (row, col) order
            return F.unfold(tokens_to_map(z, feat_size), 3, padding=1).reshape(b, d, 9, n).transpose(2, 3)
        qc, kc, vc = patches(t["q"][..., c:]), patches(t["k"][..., c:]), t["v"][..., c:].transpose(1, 2)
        uc = torch.einsum("bcnt,bcn->bct", kc, vc * s)
        normc = laf.col_norm(uc, [-1]) if self.normalize_grad else torch.ones_like(uc[..., :1])
        coef_c = lr * self.inner_steps * s / normc
        conv = laf.PatchForm(qc, kc, vc * coef_c, self.w3.to(q.dtype).reshape(d, 9), coef_c)
        return laf.ViT3Form(swiglu, conv, self.proj.weight, self.proj.bias)

    def implicit_map_io(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(v, o) through ViT3's own inner-step ops (its backend; the variant reference for the variants) on q, k
        and a leaf v: the projection is fused into the mixer's op, so it cannot be hooked."""
        from ttt_zoo.kernels import dwconv_ttt, swiglu_ttt
        from ttt_zoo.kernels.vit3_variant.naive import dwconv_variant_reference, swiglu_variant_reference
        c, d, h = self.dim, self.head_dim, self.num_heads
        with torch.no_grad():
            t = self.linear_attention_inputs(x, feat_size)
        v = t["v"].detach().requires_grad_()
        b, n = x.shape[:2]
        q1, k1, v1 = (laf.heads(z[..., :c], h) for z in (t["q"], t["k"], v))
        grid = [z[..., c:].transpose(1, 2).reshape(b, d, feat_size[0], feat_size[1]) for z in (t["q"], t["k"], v)]
        with torch.enable_grad():
            if self.is_variant:
                lr = -1.0 if self.gradient_ascent else 1.0
                o1 = swiglu_variant_reference(q1, k1, v1, self.w1, self.w2, self.scale, self.normalize_grad,
                                              self.inner_update == "last", lr, self.inner_steps)
                o2 = dwconv_variant_reference(*grid, self.w3, self.scale, self.normalize_grad, lr, self.inner_steps)
            else:
                assert self.w2 is not None
                o1 = swiglu_ttt(q1, k1, v1, self.w1, self.w2, self.scale, self.normalize_grad, backend=self.backend)
                o2 = dwconv_ttt(*grid, self.w3, self.scale, self.normalize_grad, backend=self.backend)
            o = torch.cat([laf.merge(o1), o2.flatten(2).transpose(1, 2)], -1)
        return v, o

    def extra_repr(self) -> str:
        r = f"dim={self.dim}, num_heads={self.num_heads}, scale={self.scale:.4g}, rope={self.use_rope}"
        if self.is_variant or not self.normalize_grad:
            r += (f", inner_update={self.inner_update}, inner_model={self.inner_model}, normalize_grad="
                  f"{self.normalize_grad}, gradient_ascent={self.gradient_ascent}, share_qk={self.share_qk}, "
                  f"inner_steps={self.inner_steps}")
        return r


def variant_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """A ViT3 / H-ViT3 / DiT3 checkpoint of the baseline adapted to a variant ``model`` (e.g. to fine-tune V3 or
    Q := K from ViT3 weights): the query rows of every ``qkv`` are dropped where the mixer shares q and k, and ``w2``
    where the inner model is linear.  Other keys are returned unchanged."""
    out = dict(state_dict)
    for name, m in model.named_modules():
        if not isinstance(m, ViT3TTT):
            continue
        p = f"{name}." if name else ""
        if m.w2 is None:
            out.pop(p + "w2", None)
        if m.share_qk:
            c, d = m.dim, m.head_dim
            for key in (p + "qkv.weight", p + "qkv.bias"):
                t = out.get(key)
                if t is not None and t.shape[0] == 3 * (c + d):  # [q1, k1, v1, q2, k2, v2] -> [k1, v1, k2, v2]
                    out[key] = torch.cat([t[c:3 * c], t[3 * c + d:]], dim=0)
    return out
