"""Pure-PyTorch references of the T5 and DiT5 inner test-time-training steps (the ``torch_naive`` backend).

T5, inner model per head: a 3-matrix SwiGLU f(x) = (silu(x W1) * (x W2)) W3.  One closed-form gradient step of the
dot-product loss L = -(scale / N) * sum_n <f(k_n), v_n> (inner lr 1, no gradient normalisation), then the updated
per-sample weights are applied to the queries.
DiT5, inner model f(x) = silu(x W1) W2 per head, trained for one closed-form gradient step (lr 1, no gradient
normalisation) on the regression loss L = (scale / 2N) * sum_n ||f(k_n) - v_n||^2, then applied to q.
Autograd flows through the updates.  Low-precision inputs (fp16/bf16) are computed in float32 and cast back.
"""

import torch
import torch.nn.functional as F

from ..utils import compute_dtype

__all__ = ["t5_swiglu_ttt_reference", "t5_inner_update_reference", "mlp_ttt_reference"]


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
) -> torch.Tensor:
    """One T5 inner step on (k, v), applied to q.

    Args:
        q, k, v: (B, heads, N, d).
        w1, w2, w3: (1 or B, heads, d, d) initial inner weights.
        scale: inner-loss scale (T5 uses d ** -0.5).
    Returns:
        (B, heads, N, d) in the dtype of q.
    """
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w1, w2, w3 = [t.to(dt) for t in (q, k, v, w1, w2, w3)]
    w1n, w2n, w3n = t5_inner_update_reference(k, v, w1, w2, w3, scale)
    out = (F.silu(q @ w1n) * (q @ w2n)) @ w3n
    return out.to(out_dtype)


def mlp_ttt_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One inner step of the 2-layer SiLU MLP on (k, v), applied to q.

    Args:
        q, k, v: (B, heads, N, d).
        w1, w2: (1 or B, heads, d, d) initial inner weights.
        scale: inner-loss scale (DiT5: d^-0.5).
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
    return out.to(out_dtype)
