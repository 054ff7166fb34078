"""Pure-PyTorch reference of the ViT3 inner test-time-training step.

Both ops take one closed-form gradient step of a dot-product inner loss on the keys/values and
apply the updated (per-sample) inner weights to the queries.  Autograd flows through the update.
Low-precision inputs (fp16/bf16) are computed in float32 and cast back.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils import compute_dtype
from .common import qkv_split

__all__ = ["swiglu_ttt_reference", "dwconv_ttt_reference", "qkv_ttt_naive"]


def _normalize_columns(g: torch.Tensor) -> torch.Tensor:
    # g[:, j] / (||g[:, j]||_2 + 1), norm over the input (row) dimension
    return g / (torch.linalg.vector_norm(g, ord=2, dim=[-2], keepdim=True) + 1.0)


def swiglu_ttt_reference(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        scale: float,
        normalize_grad: bool = True,
) -> torch.Tensor:
    """Simplified-SwiGLU inner learner f(x) = (x W1) * silu(x W2), one step, then applied to q.

    Args:
        q, k, v: (B, heads, N, d).
        w1, w2: (1 or B, heads, d, d) initial inner weights.
        scale: inner-loss scale; loss L = -(scale / N) * sum_n <f(k_n), v_n>.
        normalize_grad: per-column gradient normalisation g / (||g|| + 1).
    Returns:
        (B, heads, N, d) in the dtype of q.
    """
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w1, w2 = q.to(dt), k.to(dt), v.to(dt), w1.to(dt), w2.to(dt)
    n = k.shape[-2]
    e = v * (-scale / n)
    z1 = k @ w1
    z2 = k @ w2
    sig = torch.sigmoid(z2)
    kt = k.transpose(-2, -1)
    g1 = kt @ (e * z2 * sig)
    g2 = kt @ (e * z1 * sig * (1.0 + z2 * (1.0 - sig)))
    if normalize_grad:
        g1, g2 = _normalize_columns(g1), _normalize_columns(g2)
    w1n = w1 - g1
    w2n = w2 - g2
    out = (q @ w1n) * F.silu(q @ w2n)
    return out.to(out_dtype)


def dwconv_ttt_reference(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        w3: torch.Tensor,
        scale: float,
        normalize_grad: bool = True,
) -> torch.Tensor:
    """3x3 depthwise-conv inner learner, one step, then applied to q.

    Args:
        q, k, v: (B, d, H, W) maps.
        w3: (d, 1, 3, 3) initial depthwise kernel.
        scale: loss L = -(scale / (H W)) * sum dwconv(k; w3) * v.
    Returns:
        (B, d, H, W) in the dtype of q.
    """
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w3 = q.to(dt), k.to(dt), v.to(dt), w3.to(dt)
    b, d, h, w = k.shape[0], k.shape[1], k.shape[2], k.shape[3]
    if b * d == 0:  # an empty batch: grouped conv2d refuses groups=0
        return (q * w3.sum()).to(out_dtype)
    e = v * (-scale / (h * w))
    # dL/dw3[b, c, i, j] = sum_{y,x} kpad[b, c, y+i, x+j] * e[b, c, y, x]: a grouped conv of k with e
    kpad = F.pad(k, (1, 1, 1, 1)).reshape(1, b * d, h + 2, w + 2)
    g = F.conv2d(kpad, e.reshape(b * d, 1, h, w), groups=b * d).reshape(b, d, 3, 3)
    if normalize_grad:
        g = g / (torch.linalg.vector_norm(g, ord=2, dim=[-2, -1], keepdim=True) + 1.0)
    w3n = w3.reshape(1, d, 3, 3) - g
    out = F.conv2d(q.reshape(1, b * d, h, w), w3n.reshape(b * d, 1, 3, 3), padding=1, groups=b * d)
    return out.reshape(b, d, h, w).to(out_dtype)


def qkv_ttt_naive(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], w1: torch.Tensor,
                  w2: torch.Tensor, w3: torch.Tensor, feat_size: Tuple[int, int], heads: int, scale: float,
                  normalize_grad: bool = True, cos: Optional[torch.Tensor] = None,
                  sin: Optional[torch.Tensor] = None, recompute: bool = True) -> torch.Tensor:
    """Reference composition (plain autograd, which stores every intermediate: ``recompute`` is ignored; also the
    TorchScript path): projection, split, RoPE, both reference inner steps, concat."""
    b, n, c = x.shape[0], x.shape[1], x.shape[2]
    t1, t2 = qkv_split(x, weight, bias, feat_size, heads, cos, sin)
    x1 = swiglu_ttt_reference(t1[0], t1[1], t1[2], w1, w2, scale, normalize_grad)
    x2 = dwconv_ttt_reference(t2[0], t2[1], t2[2], w3, scale, normalize_grad)
    return torch.cat([x1.transpose(1, 2).reshape(b, n, c), x2.flatten(2).transpose(1, 2)], dim=-1)
