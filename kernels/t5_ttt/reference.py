"""Pure-PyTorch reference of the T5 inner test-time-training step.

Inner model per head: a 3-matrix SwiGLU f(x) = (silu(x W1) * (x W2)) W3.  One closed-form gradient step of the
dot-product loss L = -(scale / N) * sum_n <f(k_n), v_n> (inner lr 1, no gradient normalisation), then the updated
per-sample weights are applied to the queries.  Autograd flows through the update.
Low-precision inputs (fp16/bf16) are computed in float32 and cast back.
"""

import torch
import torch.nn.functional as F

__all__ = ["t5_swiglu_ttt_reference", "t5_inner_update_reference"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


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
    dt = _compute_dtype(q.dtype)
    q, k, v, w1, w2, w3 = [t.to(dt) for t in (q, k, v, w1, w2, w3)]
    w1n, w2n, w3n = t5_inner_update_reference(k, v, w1, w2, w3, scale)
    out = (F.silu(q @ w1n) * (q @ w2n)) @ w3n
    return out.to(out_dtype)
