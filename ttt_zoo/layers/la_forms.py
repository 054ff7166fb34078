"""The linear-attention forms the mixers return from ``linear_attention_form`` ("Test-Time Training with KV Binding
Is Secretly Linear Attention", Theorems 5.1-5.3).  Each mixer builds its own form (beside its forward); this module
holds only the form dataclasses and the small helpers they share.  See :mod:`ttt_zoo.analysis.linear_attention`.

An inner model whose last layer is linear and bias-free, after its inner step(s) on (k, v), reads
``o = phi(q) (S0 + sum_n phi(k_n)^T v_hat_n)``.  Several inner steps give one key block per step (concatenated
along the token axis, ``steps`` blocks of N keys).
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ttt_zoo.kernels.key_norm import key_norm_reference as key_norm  # the one key norm (T5 / DiT5), over the tokens
from ttt_zoo.kernels.rope import inner_rope as rope_half  # the one 1-D RoPE: position inside the mini-batch

from .neighborhood import neighborhood_attention_2d_torch, neighborhood_indices

__all__ = ["SwiGLUForm", "PatchForm", "KernelForm", "ScanForm", "ViT3Form", "T5Form", "VisionTTTForm",
           "heads", "merge", "inner_grads", "col_norm", "key_norm", "rope_half", "ln_grad"]


def heads(t: Tensor, h: int) -> Tensor:
    """(B, N, h * d) -> (B, h, N, d)."""
    b, n, c = t.shape
    return t.reshape(b, n, h, c // h).transpose(1, 2)


def merge(t: Tensor) -> Tensor:
    """(B, h, N, d) -> (B, N, h * d)."""
    return t.transpose(1, 2).flatten(2)


def inner_grads(loss_fn: Callable[..., Tensor], weights: Sequence[Tensor], batch: int,
                graph: bool) -> Tuple[Tensor, ...]:
    """Per-sample gradients (B, ...) of an inner loss w.r.t. inner weights (1 | B, ...), by autograd at the weights
    expanded over the batch; differentiable in the inputs when ``graph``."""
    with torch.enable_grad():
        ws = [(w if w.requires_grad else w.detach().requires_grad_()).expand(batch, *w.shape[1:]) for w in weights]
        return torch.autograd.grad(loss_fn(*ws), ws, create_graph=graph)


def col_norm(u: Tensor, dims: List[int]) -> Tensor:
    """The gradient normaliser ``||u|| + 1`` over ``dims``."""
    return torch.linalg.vector_norm(u, ord=2, dim=dims, keepdim=True) + 1.0


def ln_grad(z: Tensor, target: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    """d/dz of 1/2 ||LN(z) w + b - target||^2 (the LayerNorm backward, written out)."""
    mu = z.mean(-1, keepdim=True)
    std = torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + eps)
    xh = (z - mu) / std
    gx = (xh * w + b - target) * w
    return (gx - gx.mean(-1, keepdim=True) - xh * (gx * xh).mean(-1, keepdim=True)) / std


def _fold_steps(qk: Tensor, n: int) -> Tensor:
    """(..., steps * N) scores of the step blocks -> (..., N), summed over the steps."""
    return qk.reshape(*qk.shape[:-1], -1, n).sum(-2)


@dataclass
class SwiGLUForm:
    """ViT3 SwiGLU (or single linear) heads: ``o = gate * (q (s0 + k^T v_hat))``; q (B, h, N, d), k and v_hat
    (B, h, steps * N, d) (normaliser, lr sign and steps folded into v_hat), s0 (1, h, d, d), gate (B, h, N, d)
    (ones for the linear inner model); ``v_coef`` = d v_hat / d v with gate and normaliser fixed, (B, h, steps*N, d)."""
    q: Tensor
    k: Tensor
    v_hat: Tensor
    s0: Tensor
    gate: Tensor
    v_coef: Tensor

    def state(self) -> Tensor:
        return self.s0 + self.k.transpose(-2, -1) @ self.v_hat

    def output(self) -> Tensor:
        return self.gate * (self.q @ self.state())

    def explicit_map(self, i: int) -> Tensor:
        """(B, h, N): ``sum_steps (q_i . k_j) mean_c gate_i[c] v_coef_j[c]`` (the diagonal of d o_i / d v_j)."""
        qk = torch.einsum("bhd,bhnd->bhn", self.q[:, :, i], self.k)
        w = qk * (self.gate[:, :, i].unsqueeze(2) * self.v_coef).mean(-1)
        return _fold_steps(w, self.q.shape[2])


@dataclass
class PatchForm:
    """ViT3 3x3 depthwise-conv head, per channel: q, k (B, d, N, 9) zero-padded 3x3 patches, v_hat (B, d, N),
    s0 = w3 (d, 9), ``v_coef`` (B | 1, d, 1) = d v_hat / d v (normaliser, lr sign, steps); ``o = q (s0 + k^T v_hat)``."""
    q: Tensor
    k: Tensor
    v_hat: Tensor
    s0: Tensor
    v_coef: Tensor

    def state(self) -> Tensor:
        return self.s0 + torch.einsum("bcnt,bcn->bct", self.k, self.v_hat)

    def output(self) -> Tensor:
        return torch.einsum("bcnt,bct->bcn", self.q, self.state())

    def explicit_map(self, i: int) -> Tensor:
        """(B, 1, N): the mean over channels of ``(q_i . k_j) v_coef``."""
        qk = torch.einsum("bct,bcnt->bcn", self.q[:, :, i], self.k)
        return (qk * self.v_coef).mean(1, keepdim=True)


@dataclass
class KernelForm:
    """T5 / DiT5 core: ``o = q_hat (s0 + k_hat^T v_hat)``; q (B, h, N, d), k_hat and v_hat (B, h, steps * N, d),
    s0 (1, h, d, d); ``v_coef`` = d v_hat / d v (a scalar: the signed s / N, times the steps where they add)."""
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
        qk = torch.einsum("bhd,bhnd->bhn", self.q[:, :, i], self.k)
        return _fold_steps(qk, self.q.shape[2]) * self.v_coef


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

    q, k: (B, h, N, d + 1) with a trailing 1 (the bias row of the state); v_prime (B, h, N, d) = -lr g (g the inner
    gradient w.r.t. the inner model's output at the state entering j's mini-batch; ``lr v`` for the dot loss);
    s0 (B | 1, h, d + 1, d) = [W0; b0]; tau (b,); lr (B, h, N) signed; states (B, h, n_mb, d + 1, d): the state
    entering each mini-batch.
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
        """z_bar (B, h, N, d) = q_hat S0 + (M * q_hat k_hat^T) v'."""
        a = (self.q @ self.k.transpose(-2, -1)) * self.mask()
        return self.q @ self.s0 + a @ self.v_prime

    def token_state(self, i: int) -> Tensor:
        """The inner state token i reads (B, h, d + 1, d): ``s0 + sum_j M_ij k_j^T v'_j``."""
        w = self.mask()[i]
        return self.s0 + torch.einsum("n,bhnd,bhne->bhde", w, self.k, self.v_prime)

    def explicit_map(self, i: int) -> Tensor:
        """(B, h, N): the weight ``M_ij (q_hat_i . k_hat_j) lr_j`` of token j's update as token i reads it."""
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
        return torch.cat([merge(self.swiglu.output()), self.conv.output().transpose(1, 2)], -1)

    def output(self) -> Tensor:
        return F.linear(self.core(), self.proj_weight, self.proj_bias)

    def explicit_map(self, i: int) -> Tensor:
        """(B, h + 1, N): the SwiGLU heads, then the conv head."""
        return torch.cat([self.swiglu.explicit_map(i), self.conv.explicit_map(i)], 1)


@dataclass
class T5Form:
    """T5 / T5+ / DiT5 mixer: the TTT kernel form, optionally averaged with neighbourhood attention on the raw
    q, k, v (``na`` = (q, k, v) as (B, h, H, W, d), kernel size, dilation, scale, window clamped to the map), then
    ``proj``."""
    ttt: KernelForm
    proj_weight: Tensor
    proj_bias: Optional[Tensor]
    na: Optional[Tuple[Tensor, Tensor, Tensor]] = None
    na_kernel: int = 0
    na_scale: float = 1.0
    na_dilation: int = 1
    na_clamp: bool = False

    def _na_kw(self):
        return dict(clamp_to_map=True) if self.na_clamp else {}

    def core(self) -> Tensor:
        out = merge(self.ttt.output())
        if self.na is None:
            return out
        q, k, v = self.na
        na = neighborhood_attention_2d_torch(q, k, v, self.na_kernel, self.na_dilation, self.na_scale,
                                             **self._na_kw())
        return 0.5 * out + 0.5 * na.flatten(2, 3).transpose(1, 2).flatten(2)

    def output(self) -> Tensor:
        return F.linear(self.core(), self.proj_weight, self.proj_bias)

    def na_weights(self, i: int) -> Tensor:
        """(B, h, N): neighbourhood attention's softmax weights of query token i (natten's border rule)."""
        q, k, _ = self.na
        b, h, hh, ww, d = q.shape
        y, x = divmod(i, ww)
        rows = neighborhood_indices(hh, self.na_kernel, self.na_dilation, q.device, **self._na_kw())[y]
        cols = neighborhood_indices(ww, self.na_kernel, self.na_dilation, q.device, **self._na_kw())[x]
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
    ln_w: Optional[Tensor]
    ln_b: Optional[Tensor]
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
        return merge(self._direction(fwd) + self._direction(bwd).flip(2))

    def output(self) -> Tensor:
        z = self.core()
        w, b, eps = self.post_norm
        z = F.layer_norm(z, [z.shape[-1]], w, b, eps)
        return F.linear(F.gelu(self.u_g, approximate="tanh") * z, *self.o_proj)

    def explicit_map(self, i: int) -> Tensor:
        """(B, h, N) in token order: forward map of token i plus the backward scan's (flipped back)."""
        fwd, bwd = self.scans
        n = fwd.q.shape[2]
        return fwd.explicit_map(i) + bwd.explicit_map(n - 1 - i).flip(-1)
