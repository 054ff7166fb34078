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
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils import compute_dtype
from .common import variant_qkv_split

__all__ = ["swiglu_variant_steps", "swiglu_inner_function", "swiglu_inner_loss", "swiglu_variant_reference", "dwconv_variant_reference", "variant_qkv_naive"]


def _normalize(g: torch.Tensor, dim: List[int]) -> torch.Tensor:
    return g / (torch.linalg.vector_norm(g, 2.0, dim, True) + 1.0)


def swiglu_variant_steps(k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: Optional[torch.Tensor],
                         scale: float, normalize_grad: bool = True, last_only: bool = False, lr: float = 1.0,
                         steps: int = 1) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """The inner weights (w1, w2) before and after every step on (k, v) in the compute dtype: ``steps + 1`` pairs
    (``w2`` None for the single linear inner layer)."""
    dt = compute_dtype(k.dtype)
    k, v, w1 = k.to(dt), v.to(dt), w1.to(dt)
    wg = None if w2 is None else w2.to(dt)
    c = -scale / k.shape[-2]
    kt = k.transpose(-2, -1)
    out = [(w1, wg)]
    for _ in range(steps):
        if wg is None:
            g1 = kt @ (v * c)
        else:
            z1, z2 = k @ w1, k @ wg
            sig = torch.sigmoid(z2)
            g1 = kt @ (v * c * z2 * sig)
            if not last_only:
                g2 = kt @ (v * c * z1 * sig * (1.0 + z2 * (1.0 - sig)))
                wg = wg - lr * (_normalize(g2, [-2]) if normalize_grad else g2)
        w1 = w1 - lr * (_normalize(g1, [-2]) if normalize_grad else g1)
        out.append((w1, wg))
    return out


def swiglu_inner_function(x: torch.Tensor, w1: torch.Tensor, w2: Optional[torch.Tensor]) -> torch.Tensor:
    """The inner model f(x) = (x w1) * silu(x w2), or x w1 for the single linear layer."""
    return x @ w1 if w2 is None else (x @ w1) * F.silu(x @ w2)


def swiglu_inner_loss(k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: Optional[torch.Tensor],
                      scale: float) -> torch.Tensor:
    """The ViT3 inner loss L(W) = -scale / N * sum_n <f(k_n), v_n> per (batch, head)."""
    dt = compute_dtype(k.dtype)
    f = swiglu_inner_function(k.to(dt), w1, w2)
    return -scale / k.shape[-2] * (f * v.to(dt)).sum((-2, -1))


def swiglu_variant_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor,
                             w2: Optional[torch.Tensor], scale: float, normalize_grad: bool = True,
                             last_only: bool = False, lr: float = 1.0, steps: int = 1) -> torch.Tensor:
    """q, k, v (B, heads, N, d); w1, w2 (1 or B, heads, d, d); ``w2=None``: the single linear inner layer."""
    w1, wg = swiglu_variant_steps(k, v, w1, w2, scale, normalize_grad, last_only, lr, steps)[-1]
    return swiglu_inner_function(q.to(w1.dtype), w1, wg).to(q.dtype)


def dwconv_variant_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w3: torch.Tensor, scale: float,
                             normalize_grad: bool = True, lr: float = 1.0, steps: int = 1) -> torch.Tensor:
    """q, k, v (B, d, H, W); w3 (d, 1, 3, 3): ``steps`` steps of the 3x3 depthwise-conv inner learner."""
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w3 = q.to(dt), k.to(dt), v.to(dt), w3.to(dt)
    b, d, h, w = k.shape[0], k.shape[1], k.shape[2], k.shape[3]
    if b * d == 0:
        return (q * w3.sum()).to(out_dtype)
    e = v * (-scale / (h * w))
    kpad = F.pad(k, [1, 1, 1, 1]).reshape(1, b * d, h + 2, w + 2)
    g = F.conv2d(kpad, e.reshape(b * d, 1, h, w), groups=b * d).reshape(b, d, 3, 3)  # independent of w3
    wn = w3.reshape(1, d, 3, 3)
    for _ in range(steps):
        wn = wn - lr * (_normalize(g, [-2, -1]) if normalize_grad else g)
    out = F.conv2d(q.reshape(1, b * d, h, w), wn.expand(b, d, 3, 3).reshape(b * d, 1, 3, 3), padding=1,
                   groups=b * d)
    return out.reshape(b, d, h, w).to(out_dtype)


def variant_qkv_naive(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], w1: torch.Tensor,
                      w2: Optional[torch.Tensor], w3: torch.Tensor, feat_size: Tuple[int, int], heads: int,
                      scale: float, normalize_grad: bool = True, cos: Optional[torch.Tensor] = None,
                      sin: Optional[torch.Tensor] = None, last_only: bool = False, lr: float = 1.0,
                      share_qk: bool = False, steps: int = 1) -> torch.Tensor:
    """The variant mixer core under plain autograd (also the TorchScript path): (B, N, C) -> (B, N, C + d)."""
    b, n, c = x.shape[0], x.shape[1], x.shape[2]
    t1, t2 = variant_qkv_split(x, weight, bias, feat_size, heads, cos, sin, share_qk)
    x1 = swiglu_variant_reference(t1[0], t1[1], t1[2], w1, w2, scale, normalize_grad, last_only, lr, steps)
    x2 = dwconv_variant_reference(t2[0], t2[1], t2[2], w3, scale, normalize_grad, lr, steps)
    return torch.cat([x1.transpose(1, 2).reshape(b, n, c), x2.flatten(2).transpose(1, 2)], dim=-1)
