"""T5 TTT mixer ("Linearizing Vision Transformer with Test-Time Training", arXiv 2605.02772) and its T5+ form.

T5 keeps a softmax ViT's ``qkv`` / ``proj`` and replaces softmax attention by one test-time-training step of a
3-matrix SwiGLU inner model on instance-normalised keys, with residual depthwise convs on queries and keys.
T5+ averages that with 2-D neighbourhood attention on the same q, k, v (paper Eq. 15).
"""

from typing import Callable, Dict, Final, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.utils.checkpoint import checkpoint
from timm.layers import trunc_normal_

from ttt_zoo.kernels import key_instance_norm, last_layer_ttt, t5_swiglu_ttt
from ttt_zoo.kernels.backend import TRITON_BACKEND, tracing, resolve_backend
from ttt_zoo.kernels.inner_mlp import (last_layer_ttt_torch, t5_inner_update_reference, t5_swiglu_ttt_mix,
                                       t5_swiglu_ttt_op)
from ttt_zoo.kernels.key_norm import identity_taps, qk_norm_fold_op
from ttt_zoo.kernels.utils import cached_constant, compute_dtype
from . import la_forms as laf
from .block import map_to_tokens, tokens_as_map, tokens_to_map
from .neighborhood import neighborhood_attention_2d
from .mixer import TTTMixer, register_mixer
from .variants import VariantOptions, init_plain_step_variant

# a leaf for torch.fx wherever this module's code calls it, also from mixers whose forward lives elsewhere (DiT5's
# calls PlainStepTTT._qk_convs): timm's notrace registration patches only the traced forwards' own globals
torch.fx.wrap("key_instance_norm")

__all__ = ["T5TTT", "PlainStepTTT", "key_instance_norm", "kernel_ttt_form", "qkv_inputs", "dit5_form",
           "eager_fold", "fold_identity", "residual_dwconv", "fused_qk_convs", "stacked_heads", "NA_WEIGHT",
           "blend_na"]

NA_WEIGHT = 0.5  # T5+ / DiT5: out = (1 - NA_WEIGHT) TTT + NA_WEIGHT NA (paper Eq. 15)


def blend_na(ttt: torch.Tensor, na: Optional[torch.Tensor], na_weight: float) -> torch.Tensor:
    """(1 - na_weight) ttt + na_weight na in one launch, for the inner steps that do not blend inside their op."""
    return ttt if na is None else torch.lerp(na, ttt, 1.0 - na_weight)

def silu_gate_features(x: torch.Tensor, w1: torch.Tensor, w2: Optional[torch.Tensor]) -> torch.Tensor:
    """The frozen hidden features of the V1 variants: T5 ``silu(x W1) * (x W2)``, DiT5 ``silu(x W1)``."""
    h = F.silu(x @ w1)
    return h * (x @ w2) if w2 is not None else h


def kernel_ttt_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: Callable[..., torch.Tensor],
                    hidden_ws: Sequence[torch.Tensor], last: torch.Tensor, scale: float, loss: str,
                    update_hidden: bool, steps: int, graph: bool) -> laf.KernelForm:
    """The T5 / DiT5 inner step(s) as linear attention, q, k, v (B, h, N, d): inner model ``hidden(x, *ws) @ last``
    with the last layer linear; per step t the last layer gains ``phi_t(k)^T v_hat_t`` (one key block per step):
    ``v_hat = s v`` for the dot loss -(s/N) sum <f(k), v> (T5), ``s (v - f_t(k))`` for the regression loss
    (s/2N) sum ||f(k) - v||^2 (DiT5), s = scale / N (negative: ascent).  Hidden weights step by autograd of the loss
    (not with ``update_hidden`` False: V1; none for V3).  The read is ``phi_final(q) (last + sum_t ...)``."""
    s = scale / k.shape[2]
    ws, w = list(hidden_ws), last
    keys, vals = [], []
    for _ in range(steps):
        phi = hidden(k, *ws)
        e = s * v if loss == "dot" else s * (v - phi @ w)
        keys.append(phi)
        vals.append(e)
        if ws and update_hidden:  # all gradients at the current weights, then all steps
            if loss == "dot":
                fn = lambda *a, w=w: -(s * (hidden(k, *a) @ w) * v).sum()  # noqa: E731
            else:
                fn = lambda *a, w=w: 0.5 * s * (hidden(k, *a) @ w - v).pow(2).sum()  # noqa: E731
            gs = laf.inner_grads(fn, ws, k.shape[0], graph)
            ws = [wi - g for wi, g in zip(ws, gs)]
        w = w + phi.transpose(-2, -1) @ e
    return laf.KernelForm(hidden(q, *ws), torch.cat(keys, 2), torch.cat(vals, 2), last, s)


def qkv_inputs(m: nn.Module, x: torch.Tensor) -> Dict[str, torch.Tensor]:
    """q, k, v (B, N, C) of a fused ``qkv`` projection (q is k where it projects [k, v] only, ``share_qk``)."""
    if m.share_qk:
        k, v = m.qkv(x).chunk(2, dim=-1)
        return dict(q=k, k=k, v=v)
    q, k, v = m.qkv(x).chunk(3, dim=-1)
    return dict(q=q, k=k, v=v)


def _grid(t: Sequence[torch.Tensor], h: int, fs: Tuple[int, int]) -> Tuple[torch.Tensor, ...]:
    """(B, N, C) tensors -> (B, h, H, W, d) for neighbourhood attention."""
    return tuple(laf.heads(z, h).reshape(z.shape[0], h, fs[0], fs[1], -1) for z in t)


def _dwconv_res(z: torch.Tensor, conv: nn.Module, fs: Tuple[int, int]) -> torch.Tensor:
    return z + map_to_tokens(conv(tokens_to_map(z, fs)))


_IDENTITY_TAPS: Dict[Tuple[Tuple[int, ...], torch.device, torch.dtype], torch.Tensor] = {}


def _cached_identity_taps(w: torch.Tensor) -> torch.Tensor:
    return cached_constant(_IDENTITY_TAPS, (tuple(w.shape), w.device, w.dtype), lambda: identity_taps(w))


def eager_fold() -> bool:
    """Fold the conv residuals into the weights (:func:`fold_identity`): in eager mode and under FX.  While a graph
    is traced otherwise (TorchScript, torch.compile / export, both ONNX exporters) the convs run as ``z + conv(z)``
    on the modules' own weights, which every tracer and exporter takes (``_foreach_add`` has no ONNX function, and a
    folded weight's shape is unknown to the TorchScript exporter)."""
    if torch.jit.is_scripting():
        return False
    else:
        return not tracing()


@torch.jit.unused  # TorchScript never folds (eager_fold)
def fold_identity(ws: List[torch.Tensor]) -> List[torch.Tensor]:
    """Depthwise-conv weights with the residual folded in, ``z + conv(z, w) = conv(z, w + identity)``: one
    (multi-tensor) launch for all of them, none in the backward, instead of a residual add each way per conv.
    Eager mode and FX (:func:`eager_fold`)."""
    if is_fx_symbolic_tracing():  # the same adds, recorded per weight (bitwise the eager result)
        eye = identity_taps(ws[0])
        return [w + eye for w in ws]
    return list(torch._foreach_add(ws, [_cached_identity_taps(ws[0])] * len(ws)))


def residual_dwconv(z: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    fs: Tuple[int, int]) -> torch.Tensor:
    """``z + dwconv(z)`` ('same' padding) on (B, N, C) tokens, ``weight`` with the identity folded in."""
    return map_to_tokens(F.conv2d(tokens_as_map(z, fs), weight, bias, 1, weight.shape[-1] // 2, 1, z.shape[-1]))


@torch.jit.unused  # TorchScript never folds (eager_fold)
def fused_qk_convs(q: torch.Tensor, k: torch.Tensor, eps: float, wq: torch.Tensor, bq: Optional[torch.Tensor],
                   wk: torch.Tensor, bk: Optional[torch.Tensor], fs: Tuple[int, int], backend: Optional[str],
                   copy_qk: bool = False) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``[q + conv_q(q) | kn + conv_k(kn)]`` (B, N, 2C), kn = key_instance_norm(k), from one depthwise conv over 2C
    channels, where the key norm runs its Triton kernel (eager, not FX): that launch writes [q | kn] and the
    stacked taps (identity folded in) and biases of both convs (``key_norm.qk_norm_fold_op``): one conv and one
    conv backward instead of two each, no fold launch; then q and k for a neighbourhood attention: copies made by
    the same launch with ``copy_qk`` (their gradients are added to q's and k's in the key norm's backward launch,
    not by autograd), q and k themselves otherwise.  None elsewhere (the caller runs the two convs)."""
    if is_fx_symbolic_tracing() or bq is None or bk is None or \
            resolve_backend(backend, k.device, k.dtype, None, "key_instance_norm") != TRITON_BACKEND:
        return None
    y, w, b, *copies = qk_norm_fold_op(q, k, eps, wq, bq, wk, bk, triton=True, copy_qk=copy_qk)
    qc, kc = copies or (q, k)
    return residual_dwconv(y, w, b, fs), qc, kc


def stacked_heads(qk: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, 2C) ``[q | k]`` -> (2, B, heads, N, d), a view: the inner-step ops' stacked q, k (``k=None``)."""
    return qk.unflatten(-1, (2, num_heads, qk.shape[-1] // (2 * num_heads))).permute(2, 0, 3, 1, 4)


def dit5_form(m: nn.Module, t: Dict[str, torch.Tensor], fs: Tuple[int, int]) -> laf.T5Form:
    """:class:`~ttt_zoo.layers.DiT5MixedAttention`'s form: f(x) = silu(x W1) W2 on the regression loss, W2 the
    last layer (the one-step delta-rule values ``s (v - f(k))``); its NA half on the raw q, k, v."""
    h = m.num_heads
    q, k, v = t["q"], t["k"], t["v"]
    graph = torch.is_grad_enabled() and any(z.requires_grad for z in (q, k, v))
    sc, of = m.qk_scale_ttt, m.qk_offset_ttt
    k2 = _dwconv_res(laf.key_norm(k * sc[..., 1] + of[..., 1], 1.0), m.k_conv2d, fs)
    q2 = k2 if m.share_qk else _dwconv_res(q * sc[..., 0] + of[..., 0], m.q_conv2d, fs)
    dt = q.dtype
    hidden_ws = [] if m.linear else [m.w1.to(dt)]
    hidden = (lambda x: x) if m.linear else (lambda x, w1: F.silu(x @ w1))  # noqa: E731
    ttt = kernel_ttt_form(laf.heads(q2, h), laf.heads(k2, h), laf.heads(v, h), hidden, hidden_ws, m.w2.to(dt),
                          -m.scale if m.gradient_ascent else m.scale, "mse", m.inner_update == "all",
                          m.inner_steps, graph)
    clamp = m.dilation == 1 and min(fs) < m.kernel_size  # the mixer clamps its window to a smaller map
    return laf.T5Form(ttt, m.proj.weight, m.proj.bias, _grid((q, k, v), h, fs), m.kernel_size, m.scale, m.dilation,
                      clamp)


class PlainStepTTT(VariantOptions, TTTMixer):
    """What the T5 and DiT5 mixers share: the paper-variant options of one plain inner step (TorchScript constants:
    only the live branches are compiled), the heads and scale, and the qkv projection with the q/k convs
    (``share_qk``: the projection makes [k, v] only and there is no q conv)."""
    share_qk: Final[bool]
    na_weight: Final[float] = NA_WEIGHT  # T5+ / DiT5's blend (a TorchScript constant)
    inner_update: Final[str]
    linear: Final[bool]
    gradient_ascent: Final[bool]

    def _init_plain_step(self, dim: int, num_heads: int, inner_update: str, inner_model: Optional[str],
                         normalize_grad: bool, gradient_ascent: bool, share_qk: bool, inner_steps: int) -> int:
        """Heads, variant options and ``scale``; returns the head dim."""
        d = self._init_heads(dim, num_heads)
        init_plain_step_variant(self, inner_update, inner_model, normalize_grad, gradient_ascent, share_qk,
                                inner_steps)
        self.scale = d ** -0.5
        return d

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # B, heads, N, d

    @torch.jit.unused
    def _stacks_qk(self, q: torch.Tensor) -> bool:
        """The plain inner step runs the Triton op, which takes q and k stacked (one gradient, no ``cat``)."""
        return self.inner_steps == 1 and not self.linear and self.inner_update == "all" and \
            resolve_backend(self.backend, q.device, q.dtype, self.head_dim, self.inner_op) == TRITON_BACKEND

    @torch.jit.unused
    def _fused_qk(self, q: torch.Tensor, k: torch.Tensor, eps: float, feat_size: Tuple[int, int], copy_qk: bool
                  ) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]]:
        """:func:`fused_qk_convs` as heads: (q2, k2, q, k), or (stacked q2 and k2, None, ...) for the Triton inner
        step; None where it does not run."""
        fused = fused_qk_convs(q, k, eps, self.q_conv2d.weight, self.q_conv2d.bias, self.k_conv2d.weight,
                               self.k_conv2d.bias, feat_size, self.backend, copy_qk)
        if fused is None:
            return None
        qk, qc, kc = fused
        if self._stacks_qk(q):
            return stacked_heads(qk, self.num_heads), None, qc, kc
        q2, k2 = torch.split(qk, q.shape[-1], -1)  # backward: one cat
        return self._heads(q2), self._heads(k2), qc, kc

    def _qk_convs(self, q: torch.Tensor, k: torch.Tensor, eps: float, feat_size: Tuple[int, int],
                  copy_qk: bool = False
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(B, N, C) q, k -> the inner step's q2 = q + conv_q(q), k2 = kn + conv_k(kn), kn = key_instance_norm(k),
        as (B, heads, N, d) (``share_qk``: q2 is k2), and q, k for a neighbourhood attention (copies from the fused
        launch with ``copy_qk``: :func:`fused_qk_convs`): one fused conv where the key norm runs Triton (stacked,
        k2 None, where the inner step does too), else traced ``z + conv(z)`` or convs with the identity folded in."""
        if eager_fold() and not self.share_qk:
            fused = self._fused_qk(q, k, eps, feat_size, copy_qk)
            if fused is not None:
                return fused
        kn = key_instance_norm(k, eps, backend=self.backend)
        if not eager_fold():
            k2 = self._heads(kn + map_to_tokens(self.k_conv2d(tokens_to_map(kn, feat_size))))
            q2 = k2 if self.share_qk else self._heads(q + map_to_tokens(self.q_conv2d(tokens_to_map(q, feat_size))))
        elif self.share_qk:
            wk = fold_identity([self.k_conv2d.weight])[0]
            q2 = k2 = self._heads(residual_dwconv(kn, wk, self.k_conv2d.bias, feat_size))
        else:
            wq, wk = fold_identity([self.q_conv2d.weight, self.k_conv2d.weight])
            k2 = self._heads(residual_dwconv(kn, wk, self.k_conv2d.bias, feat_size))
            q2 = self._heads(residual_dwconv(q, wq, self.q_conv2d.bias, feat_size))
        return q2, k2, q, k

    def _init_qk_projections(self, dim: int, qkv_bias: bool, proj_drop: float) -> None:
        self._init_projections(dim, qkv_bias, proj_drop, qk_convs=True)
        if self.share_qk:  # no query: the projection makes [k, v] only
            self.qkv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
            del self.q_conv2d


@register_mixer("t5")
class T5TTT(PlainStepTTT):
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
            the lean inner-step backward then keeps training memory below a softmax ViT's.  ``None`` (default):
            recompute unless the inner step runs the Triton kernels, whose block then launches the forward once
            (13 launches fewer per training step) and stores about 6 (B, N, C) activations more per block.

    Variants of "TTT with KV Binding Is Secretly Linear Attention" (Liu et al., Tables 1-2); the defaults are T5:
        inner_update: ``'all'``; ``'last'`` = Table 2 Variant 1: only the last layer w3 learns in the inner loop
            (w1, w2 stay at their initial values), out = phi(q) (w3 + (s/N) phi(k)^T v) with
            phi(x) = silu(x w1) * (x w2): linear attention, two GEMMs per head (op ``last_layer_ttt``).
        inner_model: ``None`` (the 3-matrix SwiGLU); ``'linear'`` = Table 2 Variant 3: a single linear inner layer
            (only ``w3`` exists), out = q (w3 + (s/N) k^T v).
        normalize_grad: Table 2 Variant 6 (no gradient normalisation) *is* T5: its inner step is a plain gradient
            step (lr 1), so only ``False`` is accepted (``True`` raises).
        gradient_ascent: Table 1 "Gradient Ascent": W' = W + grad (the dot-product loss makes it exactly descent
            with v negated).
        share_qk: Table 1 "Replace Q with K": the inner model is read with the keys (the normalised, conv-enhanced
            k also serves as q); ``qkv`` projects only [k, v] (C -> 2C) and ``q_conv2d`` is dropped.  T5+'s
            neighbourhood attention then takes k as its query.
        inner_steps: inner gradient steps on (k, v) before reading with q (Figure 1: more steps at inference);
            settable after construction.  With V1/V3 the dot-product gradient does not depend on w3, so k steps
            are exactly one step with k times the update.
    """
    # new relative to a softmax ViT: the inner weights and the q/k convs (the official recipe trains all of
    # them with the larger "new parameter" learning rate, and `linearize` initialises exactly these)
    inner_param_names = ("w1", "w2", "w3", "q_conv2d", "k_conv2d")
    # the inner step's op name for backend.resolve_backend; not annotated: TorchScript sees PlainStepTTT's Final
    # constants only while this class declares no annotation of its own
    inner_op = "t5_swiglu_ttt"

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, proj_drop: float = 0.0,
                 na_kernel: int = 0, key_norm_eps: float = 1.0, backend: Optional[str] = None,
                 recompute: Optional[bool] = None, inner_update: str = "all", inner_model: Optional[str] = None,
                 normalize_grad: bool = False, gradient_ascent: bool = False, share_qk: bool = False,
                 inner_steps: int = 1):
        super().__init__()
        d = self._init_plain_step(dim, num_heads, inner_update, inner_model, normalize_grad, gradient_ascent,
                                  share_qk, inner_steps)
        if na_kernel < 0 or (na_kernel and na_kernel % 2 == 0):
            raise ValueError(f"na_kernel must be 0 (no neighbourhood attention) or odd (3, 5, ...), got {na_kernel}")
        self.na_kernel = na_kernel
        self.key_norm_eps = key_norm_eps
        self.backend = backend
        self.recompute = recompute
        if inner_model != "linear":
            self.w1 = nn.Parameter(torch.empty(1, num_heads, d, d))
            self.w2 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self.w3 = nn.Parameter(torch.empty(1, num_heads, d, d))
        self._init_qk_projections(dim, qkv_bias, proj_drop)
        self.reset_inner_parameters()

    def reset_inner_parameters(self) -> None:
        """Official init of the TTT-only parameters: w1..w3 trunc_normal(.02), q/k convs PyTorch default."""
        if self.w3.device.type == "meta":
            return
        for w in self._inner_weights():
            trunc_normal_(w, std=0.02)
        if not self.share_qk:
            self.q_conv2d.reset_parameters()
        self.k_conv2d.reset_parameters()

    def _inner_weights(self) -> Tuple[torch.Tensor, ...]:
        return (self.w3,) if self.inner_model == "linear" else (self.w1, self.w2, self.w3)

    def _inner(self, q: torch.Tensor, k: Optional[torch.Tensor], v: torch.Tensor,
               na: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The inner step(s) on (k, v), read with q: (B, heads, N, d) each (k None: q stacks q and k, the Triton
        op's form); T5+ blends in ``na`` (:func:`blend_na`), inside the inner-step op where it has one."""
        scale = -self.scale if self.gradient_ascent else self.scale  # a negative scale flips the update
        if k is None:
            return self._stacked_step(q, v, scale, na)
        if self.linear or self.inner_update == "last":
            if not self.linear:
                q, k = silu_gate_features(q, self.w1, self.w2), silu_gate_features(k, self.w1, self.w2)
            if torch.jit.is_scripting():
                return blend_na(last_layer_ttt_torch(q, k, v, self.w3, scale, "dot", self.inner_steps), na,
                                self.na_weight)
            return blend_na(last_layer_ttt(q, k, v, self.w3, scale, "dot", self.inner_steps, backend=self.backend),
                            na, self.na_weight)
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.inner_steps > 1:  # the first k - 1 steps (tiny d x d updates), then the last step + read by the op
            dt = compute_dtype(q.dtype)
            kc, vc = k.to(dt), v.to(dt)
            w1, w2, w3 = w1.to(dt), w2.to(dt), w3.to(dt)
            for _ in range(self.inner_steps - 1):
                w1, w2, w3 = t5_inner_update_reference(kc, vc, w1, w2, w3, scale)
            w1, w2, w3 = w1.to(q.dtype), w2.to(q.dtype), w3.to(q.dtype)
        if na is None:
            return t5_swiglu_ttt(q, k, v, w1, w2, w3, scale, backend=self.backend)
        return t5_swiglu_ttt_mix(q, k, v, w1, w2, w3, scale, na, self.na_weight, backend=self.backend)

    @torch.jit.unused
    def _stacked_step(self, qk: torch.Tensor, v: torch.Tensor, scale: float,
                      na: Optional[torch.Tensor]) -> torch.Tensor:
        return t5_swiglu_ttt_op(qk, None, v, self.w1, self.w2, self.w3, scale, triton=True, mix=na,
                                mix_weight=self.na_weight)

    def _core(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        """Everything between the input and ``proj``: (B, N, C) -> (B, heads, N, d)."""
        b, n, c = x.shape
        if self.share_qk:
            k, v = torch.split(self.qkv(x), [c, c], dim=-1)
            q = k
        else:
            q, k, v = torch.split(self.qkv(x), [c, c, c], dim=-1)
        q2h, k2h, q, k = self._qk_convs(q, k, self.key_norm_eps, feat_size, self.na_kernel > 0)
        na: Optional[torch.Tensor] = None
        if self.na_kernel > 0:  # T5+: blended into the inner step's output (its (B, N, heads, d) layout is kept)
            grid = (b, self.num_heads, feat_size[0], feat_size[1], c // self.num_heads)
            na = neighborhood_attention_2d(self._heads(q).reshape(grid), self._heads(k).reshape(grid),
                                           self._heads(v).reshape(grid), self.na_kernel, 1, self.scale).flatten(2, 3)
        return self._inner(q2h, k2h, self._heads(v), na)

    @torch.jit.unused
    def _recomputes(self, x: torch.Tensor) -> bool:
        if self.recompute is not None:
            return bool(self.recompute)
        op = "last_layer_ttt" if self.linear or self.inner_update == "last" else "t5_swiglu_ttt"
        return resolve_backend(self.backend, x.device, x.dtype, self.head_dim, op) != TRITON_BACKEND

    @torch.jit.unused
    def _core_recompute(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and self._recomputes(x):
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

    # ---- the exact linear-attention form (every option: T5+, V1, V3, ascent, Q := K, k steps)
    def linear_attention_unsupported(self) -> Optional[str]:
        return None

    @torch.jit.unused
    def linear_attention_inputs(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Dict[str, torch.Tensor]:
        """The raw q, k, v of ``qkv`` (q is k with ``share_qk``)."""
        return qkv_inputs(self, x)

    @torch.jit.unused
    def linear_attention_form_from_inputs(self, t: Dict[str, torch.Tensor], feat_size: Tuple[int, int]
                                          ) -> laf.T5Form:
        """f(x) = (silu(x W1) * (x W2)) W3 on the dot-product loss, W3 the last layer: ``q_hat = phi'(q)``,
        ``k_hat = phi_t(k)`` per step, ``v_hat = s v``, ``S0 = w3``, on the key-normed, DWC-enhanced q, k."""
        h = self.num_heads
        q, k, v = t["q"], t["k"], t["v"]
        graph = torch.is_grad_enabled() and any(z.requires_grad for z in (q, k, v))
        k2 = _dwconv_res(laf.key_norm(k, self.key_norm_eps), self.k_conv2d, feat_size)
        q2 = k2 if self.share_qk else _dwconv_res(q, self.q_conv2d, feat_size)
        dt = q.dtype
        hidden_ws = [] if self.linear else [self.w1.to(dt), self.w2.to(dt)]
        hidden = (lambda x: x) if self.linear else silu_gate_features  # noqa: E731
        ttt = kernel_ttt_form(laf.heads(q2, h), laf.heads(k2, h), laf.heads(v, h), hidden, hidden_ws,
                              self.w3.to(dt), -self.scale if self.gradient_ascent else self.scale, "dot",
                              self.inner_update == "all", self.inner_steps, graph)
        na = _grid((q, k, v), h, feat_size) if self.na_kernel > 0 else None
        return laf.T5Form(ttt, self.proj.weight, self.proj.bias, na, self.na_kernel, self.scale)

    def extra_repr(self) -> str:
        r = f"dim={self.dim}, num_heads={self.num_heads}, na_kernel={self.na_kernel}"
        for name, default in (("inner_update", "all"), ("inner_model", None), ("gradient_ascent", False),
                              ("share_qk", False), ("inner_steps", 1)):
            if getattr(self, name) != default:
                r += f", {name}={getattr(self, name)!r}"
        return r
