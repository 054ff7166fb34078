"""Reference of the ViT3 inner-loop variants of Liu et al., "Test-Time Training with KV Binding Is Secretly Linear
Attention" (Tables 1-2): plain PyTorch under autograd, one closed-form step per inner step.

Per (batch, head), c = -scale / N, inner loss L(W) = c * sum_n <f(k_n), v_n> (the ViT3 dot-product loss):
  swiglu, update all   f(x) = (x W1) * silu(x W2); both W1 and W2 step (the ViT3 baseline)
  swiglu, update last  the same f, only W1 (the last layer) steps; the gate W2 stays         (Table 2, Variant 1)
  linear               f(x) = x W1, one layer: dL/dW1 = c k^T v, two GEMMs per head           (Table 2, Variant 3)
Each step: W <- W - lr * N(dL/dW), N(g) = g / (||g[:, j]|| + 1) per column when ``normalize_grad`` (else identity,
Variant 6); ``lr`` = -1 is gradient ascent (Table 1).  The 3x3 depthwise-conv branch (always a single linear
layer) takes the same steps.  ``share_qk`` (Table 1, "replace Q with K") is the caller's: it passes k as q.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils import compute_dtype
from ..vit3_ttt.naive import _rope

__all__ = ["swiglu_variant_reference", "dwconv_variant_reference", "variant_qkv_split", "variant_qkv_naive"]


def _normalize(g: torch.Tensor, dim) -> torch.Tensor:
    return g / (torch.linalg.vector_norm(g, dim=dim, keepdim=True) + 1.0)


def swiglu_variant_reference(q, k, v, w1, w2: Optional[torch.Tensor], scale: float, normalize_grad: bool = True,
                             last_only: bool = False, lr: float = 1.0, steps: int = 1) -> torch.Tensor:
    """q, k, v (B, heads, N, d); w1, w2 (1 or B, heads, d, d); ``w2=None``: the single linear inner layer."""
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w1 = q.to(dt), k.to(dt), v.to(dt), w1.to(dt)
    w2 = w2.to(dt) if w2 is not None else None
    c = -scale / k.shape[-2]
    kt = k.transpose(-2, -1)
    for _ in range(steps):
        if w2 is None:
            g1, g2 = kt @ (v * c), None
        else:
            z1, z2 = k @ w1, k @ w2
            sig = torch.sigmoid(z2)
            g1 = kt @ (v * c * z2 * sig)
            g2 = None if last_only else kt @ (v * c * z1 * sig * (1.0 + z2 * (1.0 - sig)))
        if normalize_grad:
            g1 = _normalize(g1, -2)
            g2 = _normalize(g2, -2) if g2 is not None else None
        w1 = w1 - lr * g1
        if g2 is not None:
            w2 = w2 - lr * g2
    out = q @ w1 if w2 is None else (q @ w1) * F.silu(q @ w2)
    return out.to(out_dtype)


def dwconv_variant_reference(q, k, v, w3, scale: float, normalize_grad: bool = True, lr: float = 1.0,
                             steps: int = 1) -> torch.Tensor:
    """q, k, v (B, d, H, W); w3 (d, 1, 3, 3): ``steps`` steps of the 3x3 depthwise-conv inner learner."""
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w3 = q.to(dt), k.to(dt), v.to(dt), w3.to(dt)
    b, d, h, w = k.shape
    if b * d == 0:
        return (q * w3.sum()).to(out_dtype)
    e = v * (-scale / (h * w))
    kpad = F.pad(k, (1, 1, 1, 1)).reshape(1, b * d, h + 2, w + 2)
    g = F.conv2d(kpad, e.reshape(b * d, 1, h, w), groups=b * d).reshape(b, d, 3, 3)  # independent of w3
    wn = w3.reshape(1, d, 3, 3)
    for _ in range(steps):
        wn = wn - lr * (_normalize(g, (-2, -1)) if normalize_grad else g)
    out = F.conv2d(q.reshape(1, b * d, h, w), wn.reshape(b * d, 1, 3, 3), padding=1, groups=b * d)
    return out.reshape(b, d, h, w).to(out_dtype)


def variant_qkv_split(x, weight, bias, feat_size: Tuple[int, int], heads: int, cos, sin, share_qk: bool):
    """Projection -> SwiGLU-branch (q, k, v) (B, heads, N, d) and conv-branch (q, k, v) (B, d, H, W).

    ``share_qk``: the projection has no query rows (``[k1, v1, k2, v2]``, 2C + 2d outputs) and q is k."""
    b, n, c = x.shape
    h, w = feat_size
    d = c // heads
    y = F.linear(x, weight, bias)
    if share_qk:
        k1, v1, k2, v2 = torch.split(y, [c, c, d, d], dim=-1)
        q1, q2 = k1, k2
    else:
        q1, k1, v1, q2, k2, v2 = torch.split(y, [c, c, c, d, d, d], dim=-1)
    if cos is not None and sin is not None:
        k1 = _rope(k1.reshape(b, h, w, c), cos, sin).reshape(b, n, c)
        q1 = k1 if share_qk else _rope(q1.reshape(b, h, w, c), cos, sin).reshape(b, n, c)
    t1 = [t.reshape(b, n, heads, d).transpose(1, 2) for t in (q1, k1, v1)]
    t2 = [t.transpose(1, 2).reshape(b, d, h, w) for t in (q2, k2, v2)]
    return t1, t2


def variant_qkv_naive(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
                      cos=None, sin=None, last_only: bool = False, lr: float = 1.0, share_qk: bool = False,
                      steps: int = 1) -> torch.Tensor:
    """The variant mixer core under plain autograd: (B, N, C) -> (B, N, C + d)."""
    b, n, c = x.shape
    t1, t2 = variant_qkv_split(x, weight, bias, feat_size, heads, cos, sin, share_qk)
    x1 = swiglu_variant_reference(*t1, w1, w2, scale, normalize_grad, last_only, lr, steps)
    x2 = dwconv_variant_reference(*t2, w3, scale, normalize_grad, lr, steps)
    return torch.cat([x1.transpose(1, 2).reshape(b, n, c), x2.flatten(2).transpose(1, 2)], dim=-1)
