"""Every TTT mixer as the linear attention it secretly is ("Test-Time Training with KV Binding Is Secretly Linear
Attention", Theorems 5.1-5.3, Appendices F-H).

An inner model whose last layer is linear and bias-free, after one gradient step on (k, v), reads
``o = phi(q) (S0 + sum_n phi(k_n)^T v_hat_n)``: a linear attention with effective queries q_hat, keys k_hat, values
v_hat and initial state S0 (the last layer's initial weight).  :func:`linear_attention` returns these for any mixer
instance and input, one small dataclass per form; ``form.output()`` recomputes the mixer's output from them alone
(nothing of the mixer's inner-step code runs; the dynamic parts, e.g. ViT3's gate W2' after its own step, are taken
by autograd of the inner loss written here).  The forms:

- :class:`SwiGLUForm` (ViT3 SwiGLU heads): f(x) = (x W1) * silu(x W2), so W1 (our ``w1``) is the last layer,
  ``o = silu(q W2') * (q S)``, ``S = w1 + sum_n k_n^T (v_hat_n / c)``, ``v_hat = (s/N) v * silu(k w2)``, c the per-column
  normaliser ``||U[:, j]|| + 1`` of ``U = sum k^T v_hat`` (1 without ``normalize_grad``); with RoPE q, k are rotated.
- :class:`PatchForm` (ViT3 3x3 depthwise-conv head): per channel a linear attention over *all* tokens whose
  queries/keys are the 3x3 zero-padded patches (9 numbers, a sliding window of the map), ``v_hat = (s/N) v``,
  ``S0 = w3`` and the per-channel normaliser ``||U|| + 1``.
- :class:`KernelForm` (T5: ``q_hat = silu(q W1') * (q W2')``, ``k_hat = silu(k w1) * (k w2)``, ``v_hat = (s/N) v``,
  ``S0 = w3``; DiT5: ``q_hat = silu(q W1')``, ``k_hat = silu(k w1)``, ``v_hat = (s/N)(v - f0(k))`` the one-step
  delta-rule residual, ``S0 = w2``), on the key-normed, DWC-enhanced q, k.
- :class:`ScanForm` (Vision-TTT, one scan direction): ``q_hat = [q, 1]``, ``k_hat = [k, 1]`` (bias folded in),
  ``v'_j = -lr_j g_j`` with g_j the inner gradient at the state entering j's mini-batch (state-dependent: no
  parallel form across mini-batches), mask weights ``tau_{pos i}`` inside a mini-batch (inclusive) and
  ``tau_{b-1}`` for earlier ones; ``z_bar_i = q_hat_i S0 + sum_j M_ij (q_hat_i . k_hat_j) v'_j``.

Each mixer-level form (:class:`ViT3Form`, :class:`T5Form`, :class:`VisionTTTForm`) adds what surrounds the core
(projections, neighbourhood attention half, inner LayerNorm residual, post-norm, gate, output projection):
``form.core()`` is the token mixing before the output-side per-token transforms, ``form.output()`` the mixer output.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ttt_zoo.layers import DiT5MixedAttention, T5TTT, TTTLinearMixer, ViT3TTT
from ttt_zoo.layers.block import map_to_tokens, tokens_to_map
from ttt_zoo.layers.neighborhood import neighborhood_attention_2d_torch, neighborhood_indices
from ttt_zoo.layers.rope import apply_rope_2d, rope_2d_tables

__all__ = ["SwiGLUForm", "PatchForm", "KernelForm", "ScanForm", "ViT3Form", "T5Form", "VisionTTTForm",
           "linear_attention", "mixer_inputs", "form_from_inputs", "SUPPORTED_MIXERS"]


def _heads(t: Tensor, heads: int) -> Tensor:
    """(B, N, heads * d) -> (B, heads, N, d)."""
    b, n, c = t.shape
    return t.reshape(b, n, heads, c // heads).transpose(1, 2)


def _merge(t: Tensor) -> Tensor:
    """(B, heads, N, d) -> (B, N, heads * d)."""
    return t.transpose(1, 2).flatten(2)


def _inner_grads(loss_fn: Callable[..., Tensor], weights: Sequence[Tensor], batch: int,
                 graph: bool) -> Tuple[Tensor, ...]:
    """Per-sample gradients (B, ...) of an inner loss w.r.t. the (1, ...) inner weights, by autograd (each sample
    has its own inner weights: the gradient is taken at the weights expanded over the batch); differentiable in the
    inputs when ``graph``."""
    with torch.enable_grad():
        ws = [(w if w.requires_grad else w.detach().requires_grad_()).expand(batch, *w.shape[1:]) for w in weights]
        return torch.autograd.grad(loss_fn(*ws), ws, create_graph=graph)


def _col_norm(u: Tensor, dims: List[int]) -> Tensor:
    """The gradient normaliser ``||u|| + 1`` over ``dims`` (the input dimension of the inner weight)."""
    return torch.linalg.vector_norm(u, ord=2, dim=dims, keepdim=True) + 1.0


# ------------------------------------------------------------------------------------------------ the forms
@dataclass
class SwiGLUForm:
    """ViT3 SwiGLU heads: ``o = gate * (q (s0 + k^T v_hat / norm))``; tensors (B, heads, N, d), s0 (1, heads, d, d),
    norm (B | 1, heads, 1, d); ``v_coef`` = d v_hat / d v (per token and channel), for the explicit map."""
    q: Tensor
    k: Tensor
    v_hat: Tensor
    s0: Tensor
    gate: Tensor
    norm: Tensor
    v_coef: Tensor

    def state(self) -> Tensor:
        return self.s0 + self.k.transpose(-2, -1) @ self.v_hat / self.norm

    def output(self) -> Tensor:
        return self.gate * (self.q @ self.state())

    def explicit_map(self, i: int) -> Tensor:
        """(B, heads, N): ``(q_i . k_j) * mean_c gate_i[c] v_coef_j[c] / norm[c]`` (the Jacobian d o_i / d v_j with
        the gate and the normaliser held fixed is diagonal; this is its mean)."""
        qk = torch.einsum("bhd,bhnd->bhn", self.q[:, :, i], self.k)
        g = (self.gate[:, :, i] / self.norm[:, :, 0]).unsqueeze(2)
        return qk * (g * self.v_coef).mean(-1)


@dataclass
class PatchForm:
    """ViT3 3x3 depthwise-conv head, per channel: q, k (B, d, N, 9) zero-padded 3x3 patches, v_hat (B, d, N),
    s0 = w3 (d, 9), norm (B | 1, d, 1) the normaliser of ``U = sum k^T v_hat``; ``o = q (s0 + U / norm)``."""
    q: Tensor
    k: Tensor
    v_hat: Tensor
    s0: Tensor
    norm: Tensor
    v_coef: float

    def state(self) -> Tensor:
        return self.s0 + torch.einsum("bcnt,bcn->bct", self.k, self.v_hat) / self.norm

    def output(self) -> Tensor:
        return torch.einsum("bcnt,bct->bcn", self.q, self.state())

    def explicit_map(self, i: int) -> Tensor:
        """(B, 1, N): the mean over channels of ``(q_i . k_j) v_coef / norm``."""
        qk = torch.einsum("bct,bcnt->bcn", self.q[:, :, i], self.k)
        return (qk * self.v_coef / self.norm).mean(1, keepdim=True)


@dataclass
class KernelForm:
    """T5 / DiT5 core: ``o = q_hat (s0 + k_hat^T v_hat)``, all (B, heads, N, d), s0 (1, heads, d, d);
    ``v_coef`` = d v_hat / d v (a scalar: s/N)."""
    q: Tensor
    k: Tensor
    v_hat: Tensor
    s0: Tensor
    v_coef: float

    def state(self) -> Tensor:
        return self.s0 + self.k.transpose(-2, -1) @ self.v_hat

    def output(self) -> Tensor:
        return self.q @ self.state()

    def explicit_map(self, i: int) -> Tensor:
        return torch.einsum("bhd,bhnd->bhn", self.q[:, :, i], self.k) * self.v_coef


def _scan_mask(n: int, tau: Tensor) -> Tensor:
    """(N, N) weights M_ij of the mini-batch scan: tau[i mod b] for j <= i in i's mini-batch (inclusive mask),
    tau[b - 1] for j in an earlier mini-batch (the state carried on), 0 after."""
    b = tau.shape[0]
    t = torch.arange(n, device=tau.device)
    mb, pos = t // b, t % b
    same = (mb[:, None] == mb[None, :]) & (t[None, :] <= t[:, None])
    earlier = mb[None, :] < mb[:, None]
    return torch.where(same, tau[pos][:, None], torch.where(earlier, tau[b - 1], torch.zeros((), dtype=tau.dtype)))


@dataclass
class ScanForm:
    """One direction of the Vision-TTT scan in its sum form (tokens in scan order).

    q, k: (B, heads, N, d + 1) with a trailing 1 (the bias row of the state); v_prime (B, heads, N, d) = -lr g;
    s0 (B | 1, heads, d + 1, d) = [W0; b0]; tau (b,); lr (B, heads, N); states (B, heads, n_mb, d + 1, d): the
    state entering each mini-batch, ``s0 + sum_{j in earlier mini-batches} tau_{b-1} k_j^T v'_j``.
    """
    q: Tensor
    k: Tensor
    v_prime: Tensor
    s0: Tensor
    tau: Tensor
    lr: Tensor
    states: Tensor

    def mask(self) -> Tensor:
        return _scan_mask(self.q.shape[2], self.tau)

    def output(self) -> Tensor:
        """z_bar (B, heads, N, d) = q_hat S0 + (M * q_hat k_hat^T) v'."""
        a = (self.q @ self.k.transpose(-2, -1)) * self.mask()
        return self.q @ self.s0 + a @ self.v_prime

    def token_state(self, i: int) -> Tensor:
        """The inner state token i reads (B, heads, d + 1, d): ``s0 + sum_j M_ij k_j^T v'_j``."""
        w = self.mask()[i]
        return self.s0 + torch.einsum("n,bhnd,bhne->bhde", w, self.k, self.v_prime)

    def explicit_map(self, i: int) -> Tensor:
        """(B, heads, N): the weight ``M_ij (q_hat_i . k_hat_j) lr_j`` of token j's update as token i reads it
        (the map onto the values ``v'_j / -lr_j = g_j``, the inner loss gradient)."""
        qk = torch.einsum("bhd,bhnd->bhn", self.q[:, :, i], self.k)
        return qk * self.mask()[i] * self.lr


@dataclass
class ViT3Form:
    """ViT3 mixer: SwiGLU heads + the conv head, concatenated, then ``proj``."""
    swiglu: SwiGLUForm
    conv: PatchForm
    proj_weight: Tensor
    proj_bias: Optional[Tensor]

    def core(self) -> Tensor:
        """(B, N, C + d): the input of ``proj``."""
        return torch.cat([_merge(self.swiglu.output()), self.conv.output().transpose(1, 2)], -1)

    def output(self) -> Tensor:
        return F.linear(self.core(), self.proj_weight, self.proj_bias)

    def explicit_map(self, i: int) -> Tensor:
        """(B, heads + 1, N): the SwiGLU heads, then the conv head."""
        return torch.cat([self.swiglu.explicit_map(i), self.conv.explicit_map(i)], 1)


@dataclass
class T5Form:
    """T5 / T5+ / DiT5 mixer: the TTT kernel form, optionally averaged with neighbourhood attention on the raw
    q, k, v (``na`` = (q, k, v) as (B, heads, H, W, d), kernel size, scale), then ``proj``."""
    ttt: KernelForm
    proj_weight: Tensor
    proj_bias: Optional[Tensor]
    na: Optional[Tuple[Tensor, Tensor, Tensor]] = None
    na_kernel: int = 0
    na_scale: float = 1.0

    def core(self) -> Tensor:
        out = _merge(self.ttt.output())
        if self.na is None:
            return out
        q, k, v = self.na
        na = neighborhood_attention_2d_torch(q, k, v, self.na_kernel, 1, self.na_scale)
        return 0.5 * out + 0.5 * na.flatten(2, 3).transpose(1, 2).flatten(2)

    def output(self) -> Tensor:
        return F.linear(self.core(), self.proj_weight, self.proj_bias)

    def na_weights(self, i: int) -> Tensor:
        """(B, heads, N): neighbourhood attention's softmax weights of query token i (natten's border rule)."""
        q, k, _ = self.na
        b, h, hh, ww, d = q.shape
        y, x = divmod(i, ww)
        rows = neighborhood_indices(hh, self.na_kernel, 1, q.device)[y]
        cols = neighborhood_indices(ww, self.na_kernel, 1, q.device)[x]
        idx = (rows[:, None] * ww + cols[None, :]).flatten()
        kw = k.flatten(2, 3)[:, :, idx]
        attn = torch.einsum("bhd,bhkd->bhk", q.flatten(2, 3)[:, :, i] * self.na_scale, kw).softmax(-1)
        return torch.zeros(b, h, hh * ww, dtype=q.dtype, device=q.device).index_add(2, idx, attn)

    def explicit_map(self, i: int) -> Tensor:
        m = self.ttt.explicit_map(i)
        return m if self.na is None else 0.5 * m + 0.5 * self.na_weights(i)


@dataclass
class VisionTTTForm:
    """Vision-TTT mixer: the forward scan and the scan of the flipped sequence (:class:`ScanForm` each, in its own
    order), per direction ``out = q + LN(z_bar) * ln_w + ln_b`` (``ln_residual``) or ``z_bar``, summed
    (``Z_forth + flip(Z_back)``), then ``o_proj(gelu_tanh(u_g) * post_norm(Z))``."""
    scans: Tuple[ScanForm, ScanForm]
    ln_residual: bool
    ln_w: Tensor
    ln_b: Tensor
    eps: float
    u_g: Tensor
    post_norm: Tuple[Tensor, Tensor, float]
    o_proj: Tuple[Tensor, Optional[Tensor]]

    def _direction(self, s: ScanForm) -> Tensor:
        z = s.output()
        if not self.ln_residual:
            return z
        d = z.shape[-1]
        return s.q[..., :d] + F.layer_norm(z, [d], eps=self.eps) * self.ln_w + self.ln_b

    def core(self) -> Tensor:
        """(B, N, C): Z, the input of the post-norm."""
        fwd, bwd = self.scans
        return _merge(self._direction(fwd) + self._direction(bwd).flip(2))

    def output(self) -> Tensor:
        z = self.core()
        w, b, eps = self.post_norm
        z = F.layer_norm(z, [z.shape[-1]], w, b, eps)
        return F.linear(F.gelu(self.u_g, approximate="tanh") * z, *self.o_proj)

    def explicit_map(self, i: int) -> Tensor:
        """(B, heads, N) in token order: forward map of token i plus the backward scan's (flipped back)."""
        fwd, bwd = self.scans
        n = fwd.q.shape[2]
        return fwd.explicit_map(i) + bwd.explicit_map(n - 1 - i).flip(-1)


# --------------------------------------------------------------------------- projections (stage 1) per mixer
def _vit3_inputs(m: ViT3TTT, x: Tensor, fs: Tuple[int, int]) -> Dict[str, Tensor]:
    b, n, c = x.shape
    d = m.head_dim
    q1, k1, v1, q2, k2, v2 = torch.split(m.qkv(x), [c, c, c, d, d, d], dim=-1)
    if m.use_rope:
        cos, sin = rope_2d_tables(fs, c, m.rope_base, device=x.device)
        q1 = apply_rope_2d(q1.reshape(b, fs[0], fs[1], c), cos, sin).reshape(b, n, c)
        k1 = apply_rope_2d(k1.reshape(b, fs[0], fs[1], c), cos, sin).reshape(b, n, c)
    return dict(q=torch.cat([q1, q2], -1), k=torch.cat([k1, k2], -1), v=torch.cat([v1, v2], -1))


def _t5_inputs(m, x: Tensor, fs: Tuple[int, int]) -> Dict[str, Tensor]:
    q, k, v = m.qkv(x).chunk(3, dim=-1)
    return dict(q=q, k=k, v=v)


def _visionttt_inputs(m: TTTLinearMixer, x: Tensor, fs: Tuple[int, int]) -> Dict[str, Tensor]:
    c = x.shape[2]

    def conv(t):
        return map_to_tokens(F.conv2d(tokens_to_map(t, fs), m.conv.weight, None, padding=1, groups=c))
    src = conv(x) if m.qk_mode == "shared" else x
    u_qk, u_g, u_v = torch.split(F.linear(src, m.proj.weight, m.proj.bias), [c, c, c], dim=-1)
    q = conv(u_qk) if m.qk_mode == "conv_q" else u_qk
    lr = (m.base_lr / m.head_dim) * torch.sigmoid(F.linear(src, m.lr_proj.weight, m.lr_proj.bias))
    return dict(q=q, k=u_qk, v=u_v, u_g=u_g, lr=lr)


# ------------------------------------------------------------------------------ the forms (stage 2) per mixer
def _vit3_form(m: ViT3TTT, t: Dict[str, Tensor], fs: Tuple[int, int]) -> ViT3Form:
    c, d, h = m.dim, m.head_dim, m.num_heads
    b, n = t["q"].shape[:2]
    q, k, v = (_heads(t[s][..., :c], h) for s in "qkv")
    graph = torch.is_grad_enabled() and any(t[s].requires_grad for s in "qkv")
    s = m.scale / n
    w1, w2 = m.w1.to(q.dtype), m.w2.to(q.dtype)
    v_coef = s * F.silu(k @ w2)
    v_hat = v * v_coef
    u = k.transpose(-2, -1) @ v_hat  # = -dL/dW1: the sum of the outer products
    # the gate's own step: W2' = w2 - dL/dW2 (normalised), L = -(s/N) sum <(k w1) * silu(k w2), v>
    g2, = _inner_grads(lambda w: -(s * (k @ w1) * F.silu(k @ w) * v).sum(), [w2], b, graph)
    norm = torch.ones_like(u[:, :, :1])
    if m.normalize_grad:
        norm = _col_norm(u, [-2])
        g2 = g2 / _col_norm(g2, [-2])
    swiglu = SwiGLUForm(q, k, v_hat, w1, F.silu(q @ (w2 - g2)), norm, v_coef)

    def patches(z):  # (B, N, d) tokens -> (B, d, N, 9) zero-padded 3x3 patches, in w3's (row, col) order
        return F.unfold(tokens_to_map(z, fs), 3, padding=1).reshape(b, d, 9, n).transpose(2, 3)
    qc, kc, vc = patches(t["q"][..., c:]), patches(t["k"][..., c:]), t["v"][..., c:].transpose(1, 2)
    vhc = vc * s
    uc = torch.einsum("bcnt,bcn->bct", kc, vhc)
    normc = _col_norm(uc, [-1]) if m.normalize_grad else torch.ones_like(uc[..., :1])
    conv = PatchForm(qc, kc, vhc, m.w3.to(q.dtype).reshape(d, 9), normc, s)
    return ViT3Form(swiglu, conv, m.proj.weight, m.proj.bias)


def _key_norm(k: Tensor, eps: float) -> Tensor:
    return (k - k.mean(1, keepdim=True)) / torch.sqrt(k.var(1, unbiased=False, keepdim=True) + eps)


def _t5_form(m, t: Dict[str, Tensor], fs: Tuple[int, int]) -> T5Form:
    h = m.num_heads
    q, k, v = t["q"], t["k"], t["v"]
    graph = torch.is_grad_enabled() and any(t[s].requires_grad for s in "qkv")
    dit5 = isinstance(m, DiT5MixedAttention)
    if dit5:  # per-channel affine of the TTT path's q and k
        q = q * m.qk_scale_ttt[..., 0] + m.qk_offset_ttt[..., 0]
        k = k * m.qk_scale_ttt[..., 1] + m.qk_offset_ttt[..., 1]
    k = _key_norm(k, 1.0 if dit5 else m.key_norm_eps)
    q = q + map_to_tokens(m.q_conv2d(tokens_to_map(q, fs)))
    k = k + map_to_tokens(m.k_conv2d(tokens_to_map(k, fs)))
    qh, kh, vh = _heads(q, h), _heads(k, h), _heads(v, h)
    s = m.scale / qh.shape[2]
    if dit5:  # f(x) = silu(x W1) W2, regression loss (s/2N) sum ||f(k) - v||^2: W2 is the last layer
        w1, w2 = m.w1.to(q.dtype), m.w2.to(q.dtype)
        k_hat = F.silu(kh @ w1)
        g1, = _inner_grads(lambda w: 0.5 * s * (F.silu(kh @ w) @ w2 - vh).pow(2).sum(), [w1], qh.shape[0], graph)
        ttt = KernelForm(F.silu(qh @ (w1 - g1)), k_hat, s * (vh - k_hat @ w2), w2, s)
        na, kernel = (t["q"], t["k"], t["v"]), m.kernel_size
        if m.dilation != 1:
            raise NotImplementedError("linear_attention: DiT5 with dilation != 1 is not covered")
    else:  # f(x) = (silu(x W1) * (x W2)) W3, dot-product loss -(s/N) sum <f(k), v>: W3 is the last layer
        w1, w2, w3 = m.w1.to(q.dtype), m.w2.to(q.dtype), m.w3.to(q.dtype)
        k_hat = F.silu(kh @ w1) * (kh @ w2)
        g1, g2 = _inner_grads(lambda a, c: -(s * ((F.silu(kh @ a) * (kh @ c)) @ w3) * vh).sum(), [w1, w2],
                              qh.shape[0], graph)
        ttt = KernelForm(F.silu(qh @ (w1 - g1)) * (qh @ (w2 - g2)), k_hat, s * vh, w3, s)
        na, kernel = ((t["q"], t["k"], t["v"]) if m.na_kernel > 0 else None), m.na_kernel
    if na is not None:
        grid = lambda z: _heads(z, h).reshape(z.shape[0], h, fs[0], fs[1], -1)  # noqa: E731
        na = tuple(grid(z) for z in na)
    return T5Form(ttt, m.proj.weight, m.proj.bias, na, kernel, m.scale)


def _rope_half(x: Tensor, b: int, theta: float) -> Tensor:
    """Rotary embedding of the position inside the mini-batch (t mod b), rotate-half pairs (p, p + d/2)."""
    n, d = x.shape[-2], x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    ang = (torch.arange(n, device=x.device) % b).to(torch.float64)[:, None] * freq
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _ln_grad(z: Tensor, target: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    """d/dz of 1/2 ||LN(z) w + b - target||^2 (the LayerNorm backward, written out)."""
    mu = z.mean(-1, keepdim=True)
    std = torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + eps)
    xh = (z - mu) / std
    gx = (xh * w + b - target) * w
    return (gx - gx.mean(-1, keepdim=True) - xh * (gx * xh).mean(-1, keepdim=True)) / std


def _scan_form(m: TTTLinearMixer, q: Tensor, k: Tensor, v: Tensor, lr: Tensor, s0: Tensor, tau: Tensor,
               lnw: Tensor, lnb: Tensor) -> ScanForm:
    """Run the sum-form recursion of one direction: the state per mini-batch from the earlier v'."""
    bsz, h, n, d = q.shape
    if m.inner_rope:
        q, k = _rope_half(q, m.mini_batch, m.rope_theta), _rope_half(k, m.mini_batch, m.rope_theta)
    one = torch.ones_like(q[..., :1])
    qa, ka = torch.cat([q, one], -1), torch.cat([k, one], -1)
    state = s0.expand(bsz, h, d + 1, d)
    vps, states = [], []
    for st in range(0, n, m.mini_batch):
        sl = slice(st, min(st + m.mini_batch, n))
        z = ka[:, :, sl] @ state
        if m.inner_ln_residual:  # f(x) = x + LN(x W + b), target v - k
            g = _ln_grad(z, v[:, :, sl] - k[:, :, sl], lnw, lnb, 1e-6)
        else:  # f(x) = x W + b, target v
            g = z - v[:, :, sl]
        vp = -lr[:, :, sl, None] * g
        states.append(state)
        vps.append(vp)
        state = state + tau[-1] * ka[:, :, sl].transpose(-2, -1) @ vp
    return ScanForm(qa, ka, torch.cat(vps, 2), s0, tau, lr, torch.stack(states, 2))


def _visionttt_form(m: TTTLinearMixer, t: Dict[str, Tensor], fs: Tuple[int, int]) -> VisionTTTForm:
    h, d = m.num_heads, m.head_dim
    q, k, v = _heads(t["q"], h), _heads(t["k"], h), _heads(t["v"], h)
    lr = t["lr"].transpose(1, 2)
    dt = q.dtype
    tau = F.relu(1.0 / torch.arange(1, m.mini_batch + 1, dtype=dt, device=q.device) + m.tau_offset.to(dt))
    lnw, lnb = m.ttt_norm_weight.to(dt).reshape(1, h, 1, d), m.ttt_norm_bias.to(dt).reshape(1, h, 1, d)
    s0 = torch.cat([m.w0, m.b0], 2).to(dt)  # (1 | 2, heads, d + 1, d)
    flip = lambda z: z.flip(2)  # noqa: E731
    fwd = _scan_form(m, q, k, v, lr, s0[:1], tau, lnw, lnb)
    bwd = _scan_form(m, flip(q), flip(k), flip(v), flip(lr), s0[-1:], tau, lnw, lnb)
    pn = m.post_norm
    return VisionTTTForm((fwd, bwd), m.inner_ln_residual, lnw, lnb, 1e-6, t["u_g"], (pn.weight, pn.bias, pn.eps),
                         (m.o_proj.weight, m.o_proj.bias))


#: mixer class -> (projections, form); the one place that says which mixers have a linear-attention form
SUPPORTED_MIXERS = {
    ViT3TTT: (_vit3_inputs, _vit3_form),
    T5TTT: (_t5_inputs, _t5_form),
    DiT5MixedAttention: (_t5_inputs, _t5_form),
    TTTLinearMixer: (_visionttt_inputs, _visionttt_form),
}


def _entry(mixer):
    for cls, fns in SUPPORTED_MIXERS.items():
        if type(mixer) is cls:
            return fns
    raise TypeError(f"no linear-attention form for {type(mixer).__name__}; supported mixers: "
                    f"{', '.join(c.__name__ for c in SUPPORTED_MIXERS)}")


def _check(x: Tensor, feat_size: Tuple[int, int]) -> Tuple[int, int]:
    fs = (int(feat_size[0]), int(feat_size[1]))
    if x.dim() != 3 or x.shape[1] != fs[0] * fs[1]:
        raise ValueError(f"x must be (B, N, C) tokens with N = H * W = {fs[0] * fs[1]} for feat_size={fs}, "
                         f"got shape {tuple(x.shape)}")
    return fs


def mixer_inputs(mixer, x: Tensor, feat_size: Tuple[int, int]) -> Dict[str, Tensor]:
    """Stage 1, the projections: q, k, v (B, N, channels) in token order (+ Vision-TTT's gate input u_g and lr).
    ``v`` here is the value every attention map is taken against."""
    return _entry(mixer)[0](mixer, x, _check(x, feat_size))


def form_from_inputs(mixer, inputs: Dict[str, Tensor], feat_size: Tuple[int, int]):
    """Stage 2: the linear-attention form from :func:`mixer_inputs` (differentiable in them)."""
    return _entry(mixer)[1](mixer, inputs, (int(feat_size[0]), int(feat_size[1])))


def linear_attention(mixer, x: Tensor, feat_size: Tuple[int, int]):
    """The exact linear-attention form of ``mixer`` on tokens ``x`` (B, N, C) of a ``feat_size`` = (H, W) map:
    a :class:`ViT3Form`, :class:`T5Form` (T5, T5+, DiT5) or :class:`VisionTTTForm`.  ``form.output()`` equals
    ``mixer(x, feat_size)`` (to rounding; mixers in eval mode, no dropout)."""
    return form_from_inputs(mixer, mixer_inputs(mixer, x, feat_size), feat_size)
