"""Pure-PyTorch references of the T5 and DiT5 inner test-time-training steps (the ``torch_naive`` backend).

T5, inner model per head: a 3-matrix SwiGLU f(x) = (silu(x W1) * (x W2)) W3.  One closed-form gradient step of the
dot-product loss L = -(scale / N) * sum_n <f(k_n), v_n> (inner lr 1, no gradient normalisation), then the updated
per-sample weights are applied to the queries.
DiT5, inner model f(x) = silu(x W1) W2 per head, trained for one closed-form gradient step (lr 1, no gradient
normalisation) on the regression loss L = (scale / 2N) * sum_n ||f(k_n) - v_n||^2, then applied to q.
Autograd flows through the updates.  Low-precision inputs (fp16/bf16) are computed in float32 and cast back.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from ..utils import compute_dtype

__all__ = ["t5_swiglu_ttt_reference", "t5_inner_update_reference", "mlp_ttt_reference", "mlp_inner_update_reference",
           "last_layer_ttt_reference"]


def t5_inner_update_reference(k, v, w1, w2, w3, scale: float):
    """Return the updated weights (W1', W2', W3'), each (B, heads, d, d), in the compute dtype."""
    n = k.shape[-2]
    e = v * (-scale / n)                      # dL/df(k_n)
    z1 = k @ w1
    z2 = k @ w2
    s = torch.sigmoid(z1)
    a1 = z1 * s                               # silu(z1)
    a2 = a1 * z2                              # hidden of the inner SwiGLU
    da2 = e @ w3.transpose(-2, -1)
    kt = k.transpose(-2, -1)
    g1 = kt @ (da2 * z2 * s * (1.0 + z1 * (1.0 - s)))   # silu'(z) = s (1 + z (1 - s))
    g2 = kt @ (da2 * a1)
    g3 = a2.transpose(-2, -1) @ e
    return w1 - g1, w2 - g2, w3 - g3


def t5_swiglu_ttt_reference(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        scale: float,
        mix: Optional[torch.Tensor] = None,
        mix_weight: float = 0.0,
) -> torch.Tensor:
    """One T5 inner step on (k, v), applied to q.

    Args:
        q, k, v: (B, heads, N, d).
        w1, w2, w3: (1 or B, heads, d, d) initial inner weights.
        scale: inner-loss scale (T5 uses d ** -0.5).
        mix, mix_weight: optional (B, heads, N, d) blended in: (1 - mix_weight) out + mix_weight mix (T5+: the
            neighbourhood attention, weight 0.5).
    Returns:
        (B, heads, N, d) in the dtype of q.
    """
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w1, w2, w3 = [t.to(dt) for t in (q, k, v, w1, w2, w3)]
    w1n, w2n, w3n = t5_inner_update_reference(k, v, w1, w2, w3, scale)
    out = (F.silu(q @ w1n) * (q @ w2n)) @ w3n
    return _blend(out, mix, mix_weight).to(out_dtype)


def _blend(out: torch.Tensor, mix: Optional[torch.Tensor], mix_weight: float) -> torch.Tensor:
    """(1 - a) out + a mix in out's (compute) dtype; out itself without a mix."""
    if mix is None:
        return out
    return out * (1.0 - mix_weight) + mix.to(out.dtype) * mix_weight


def mlp_ttt_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      scale: float, mix: Optional[torch.Tensor] = None, mix_weight: float = 0.0) -> torch.Tensor:
    """One inner step of the 2-layer SiLU MLP on (k, v), applied to q.

    Args:
        q, k, v: (B, heads, N, d).
        w1, w2: (1 or B, heads, d, d) initial inner weights.
        scale: inner-loss scale (DiT5: d^-0.5).
        mix, mix_weight: as in :func:`t5_swiglu_ttt_reference` (DiT5: the neighbourhood attention, 0.5).
    Returns:
        (B, heads, N, d) in the dtype of q.
    """
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w1, w2 = (t.to(dt) for t in (q, k, v, w1, w2))
    n = k.shape[-2]
    z = k @ w1
    sig = torch.sigmoid(z)
    a = z * sig  # silu(z)
    e = (a @ w2 - v) * (scale / n)  # dL/df
    g2 = a.transpose(-2, -1) @ e
    g1 = k.transpose(-2, -1) @ ((e @ w2.transpose(-2, -1)) * sig * (1 + z * (1 - sig)))  # silu'(z)
    out = F.silu(q @ (w1 - g1)) @ (w2 - g2)
    return _blend(out, mix, mix_weight).to(out_dtype)


def mlp_inner_update_reference(k, v, w1, w2, scale: float):
    """DiT5: the updated weights (W1', W2') of one step (lr 1) of :func:`mlp_ttt_reference`'s regression loss."""
    n = k.shape[-2]
    z = k @ w1
    sig = torch.sigmoid(z)
    a = z * sig
    e = (a @ w2 - v) * (scale / n)
    g2 = a.transpose(-2, -1) @ e
    g1 = k.transpose(-2, -1) @ ((e @ w2.transpose(-2, -1)) * sig * (1 + z * (1 - sig)))
    return w1 - g1, w2 - g2


def last_layer_ttt_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: float,
                             loss: str = "dot", steps: int = 1) -> torch.Tensor:
    """``steps`` inner steps (lr 1) of the linear last layer ``f(x) = x W`` on fixed features, applied to q.

    The T5 / DiT5 variants V1 (only the last layer learns: q, k are the frozen hidden features phi(q), phi(k)) and
    V3 (a single linear inner layer: q, k themselves).  Losses, per (batch, head), N tokens:
    ``dot``: L = -(scale / N) sum_n <k_n W, v_n> (T5);  ``mse``: L = (scale / 2N) sum_n ||k_n W - v_n||^2 (DiT5).
    A negative ``scale`` is gradient ascent.  Written plainly: the gradient of the explicit loss by autograd.

    Args:
        q, k: (B, heads, N, dh) features; v: (B, heads, N, d); w: (1 or B, heads, dh, d).
    """
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w = (t.to(dt) for t in (q, k, v, w))
    n = k.shape[-2]
    w = w.expand(k.shape[0], *w.shape[1:])  # per-sample weights: each sample's loss moves only its own copy
    outer = torch.is_grad_enabled()
    with torch.enable_grad():
        for _ in range(steps):
            w = w if w.requires_grad else w.detach().requires_grad_(True)
            f = k @ w
            if loss == "dot":
                l_ = -(scale / n) * (f * v).sum()
            elif loss == "mse":
                l_ = (scale / (2 * n)) * (f - v).pow(2).sum()
            else:
                raise ValueError(f"loss must be 'dot' or 'mse', got {loss!r}")
            w = w - torch.autograd.grad(l_, w, create_graph=outer)[0]
    return (q @ w).to(out_dtype)
