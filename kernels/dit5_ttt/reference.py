"""Pure-PyTorch reference of the DiT5 inner test-time-training step.

Inner model f(x) = silu(x W1) W2 per head, trained for one closed-form gradient step (lr 1, no gradient
normalisation) on the regression loss L = (scale / 2N) * sum_n ||f(k_n) - v_n||^2, then applied to q.
Autograd flows through the update.  Low-precision inputs are computed in float32 and cast back.
"""

import torch
import torch.nn.functional as F

__all__ = ["mlp_ttt_reference"]


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
    dt = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
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
