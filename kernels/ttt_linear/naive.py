"""Pure-PyTorch reference of TTT-Linear (Sun et al.), mini-batch dual form, as Vision-TTT uses it: the ``torch_naive``
backend and the ground truth of the tests (float64-capable, differentiated by autograd).

Per head the inner model is ``f(x) = x + LN(x W + b)`` (``ln_residual=True``, ttt-lm) or ``f(x) = x W + b``
(``ln_residual=False``, the paper's Eq. 4).  Token j's loss is ``1/2 ||LN(k_j W + b) - (v_j - k_j)||^2``
(or ``1/2 ||k_j W + b - v_j||^2``).  Inside a mini-batch every gradient is taken at the mini-batch's incoming
state and token i reads ``W_i = W_0 - sum_{j<=i} eta_ij k_j^T g_j`` (inclusive causal mask); the step is
factorised as ``eta_ij = tau_i * lr_j`` (tau by position in the mini-batch, lr per token).  Only one state
``(B, heads, d, d)`` per mini-batch exists at a time; nothing of size B x N x d x d is formed.

The fast PyTorch form of the same scan (batched over mini-batches, TorchScript / export friendly) is
``chunked.ttt_linear_chunked``; the helpers both use live in ``common.py``.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .common import bidir_inputs, bidir_outputs, scan_setup

__all__ = ["ttt_linear_naive", "ttt_linear_bidir_naive", "ln_l2_grad"]


def ln_l2_grad(z: torch.Tensor, target: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor,
               eps: float = 1e-6) -> torch.Tensor:
    """d/dz of ``1/2 ||LN(z) - target||^2`` over the last dim (closed-form LayerNorm backward)."""
    d = z.shape[-1]
    mu = z.mean(-1, keepdim=True)
    std = (z.var(-1, keepdim=True, unbiased=False) + eps).sqrt()
    x_hat = (z - mu) / std
    gx = (ln_w * x_hat + ln_b - target) * ln_w
    return (d * gx - gx.sum(-1, keepdim=True) - x_hat * (gx * x_hat).sum(-1, keepdim=True)) / (d * std)


def ttt_linear_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                     w0: torch.Tensor, b0: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, mini_batch: int = 16,
                     ln_residual: bool = True, eps: float = 1e-6, return_grad_norm: bool = False
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal TTT-Linear scan in the mini-batch dual form, written plainly: per mini-batch the state
    recursion, the outputs formed from each mini-batch's incoming state.

    Args:
        q, k, v: (B, heads, N, d) queries, keys, values in scan order.
        lr: (B, heads, N) per-token learning rate (already ``base_lr * sigmoid(.) / d``).
        tau: (mini_batch,) position factor inside a mini-batch (see ``common.token_tau``).
        w0: (B or 1, heads, d, d) initial inner weight; b0: (B or 1, heads, 1, d) initial bias.
        ln_w, ln_b: (heads, d) per-head inner LayerNorm (unused when ``ln_residual=False``).
        mini_batch: tokens per gradient step; a shorter last mini-batch uses ``tau[:r]``.
        return_grad_norm: also return ``||grad_W l_t||_F = ||k_t|| * ||g_t||`` per token, (B, heads, N).
    fp16/bf16 inputs are computed in float32 (state, LayerNorm statistics) and the output cast back.
    Returns:
        (out (B, heads, N, d), grad_norm or None)
    """
    out_dtype = q.dtype
    cd, lnw, lnb, w, b = scan_setup(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch)
    n, d = q.shape[2], q.shape[3]
    q, k, v, lr, tau = q.to(cd), k.to(cd), v.to(cd), lr.to(cd), tau.to(cd)
    outs: List[torch.Tensor] = []
    norms: List[torch.Tensor] = []
    for s in range(0, n, mini_batch):
        e = min(s + mini_batch, n)
        qc, kc = q[:, :, s:e], k[:, :, s:e]
        tc = v[:, :, s:e] - kc if ln_residual else v[:, :, s:e]
        eta = torch.tril(tau[:e - s, None] * lr[:, :, None, s:e])  # eta_ij = tau_i lr_j, j <= i
        z = kc @ w + b
        g = ln_l2_grad(z, tc, lnw, lnb, eps) if ln_residual else z - tc
        z_bar = qc @ w + b - (eta * (qc @ kc.transpose(-1, -2) + 1.0)) @ g
        outs.append(qc + F.layer_norm(z_bar, [d], eps=eps) * lnw + lnb if ln_residual else z_bar)
        if return_grad_norm:
            norms.append(torch.linalg.vector_norm(kc, dim=-1) * torch.linalg.vector_norm(g, dim=-1))
        step = eta[:, :, -1, :, None] * g  # the last row carries the state on
        w = w - kc.transpose(-1, -2) @ step
        b = b - step.sum(-2, keepdim=True)
    out = torch.cat(outs, dim=2).to(out_dtype)
    return out, (torch.cat(norms, dim=2) if return_grad_norm else None)


def ttt_linear_bidir_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                           w0: torch.Tensor, b0: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor,
                           mini_batch: int = 16, ln_residual: bool = True, rope_theta: Optional[float] = 10000.0,
                           eps: float = 1e-6, return_grad_norm: bool = False
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward scan + scan of the flipped sequence, summed: ``Z_forth + flip(Z_back)`` (Vision-TTT Eq. 12), with
    :func:`ttt_linear_naive` (the ``torch_naive`` backend, plain autograd: the float64 ground truth).

    Both directions run in one call, stacked on the batch axis (2B).  ``w0``/``b0`` are (1 | 2, heads, ...):
    one state shared by both directions, or one per direction (index 0 forward, 1 backward).  Each direction
    forms its mini-batches (and in-chunk RoPE positions, ``rope_theta=None`` disables) in its own order.
    Returns (out (B, heads, N, d), grad_norm (2, B, heads, N) in original token order, or None).
    """
    q2, k2, v2, lr2, w0, b0 = bidir_inputs(q, k, v, lr, w0, b0, mini_batch, rope_theta)
    out, gn = ttt_linear_naive(q2, k2, v2, lr2, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps,
                               return_grad_norm)
    return bidir_outputs(out, gn, q.shape[0])
