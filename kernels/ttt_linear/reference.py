"""Pure-PyTorch reference of TTT-Linear (Sun et al.), mini-batch dual form, as Vision-TTT uses it.

Per head the inner model is ``f(x) = x + LN(x W + b)`` (``ln_residual=True``, ttt-lm) or ``f(x) = x W + b``
(``ln_residual=False``, the paper's Eq. 4).  Token j's loss is ``1/2 ||LN(k_j W + b) - (v_j - k_j)||^2``
(or ``1/2 ||k_j W + b - v_j||^2``).  Inside a mini-batch every gradient is taken at the mini-batch's incoming
state and token i reads ``W_i = W_0 - sum_{j<=i} eta_ij k_j^T g_j`` (inclusive causal mask); the step is
factorised as ``eta_ij = tau_i * lr_j`` (tau by position in the mini-batch, lr per token).  Only one state
``(B, heads, d, d)`` per mini-batch exists at a time; nothing of size B x N x d x d is formed.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["ttt_linear_reference", "ttt_linear_bidir", "ln_l2_grad", "inner_rope", "token_tau"]


def ln_l2_grad(z: torch.Tensor, target: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor,
               eps: float = 1e-6) -> torch.Tensor:
    """d/dz of ``1/2 ||LN(z) - target||^2`` over the last dim (closed-form LayerNorm backward)."""
    d = z.shape[-1]
    mu = z.mean(-1, keepdim=True)
    std = (z.var(-1, keepdim=True, unbiased=False) + eps).sqrt()
    x_hat = (z - mu) / std
    gx = (ln_w * x_hat + ln_b - target) * ln_w
    return (d * gx - gx.sum(-1, keepdim=True) - x_hat * (gx * x_hat).sum(-1, keepdim=True)) / (d * std)


def token_tau(tau_offset: torch.Tensor) -> torch.Tensor:
    """Position factor inside a mini-batch: ``tau_i = max(0, 1/i + offset_i)``, i = 1..b."""
    b = tau_offset.shape[-1]
    pos = torch.arange(1, b + 1, device=tau_offset.device, dtype=tau_offset.dtype)
    return F.relu(1.0 / pos + tau_offset)


def inner_rope(x: torch.Tensor, mini_batch: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of the position inside the mini-batch (``t mod b``) on ``x: (B, heads, N, d)``.

    Rotate-half layout: channel p pairs with channel p + d/2.
    """
    n, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ValueError(f"inner RoPE needs an even head dim, got {d}")
    freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d))
    pos = (torch.arange(n, device=x.device) % mini_batch).to(torch.float64)
    ang = pos[:, None] * freq[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _layer_norm(z: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(z, (z.shape[-1],), eps=eps) * w + b


def ttt_linear_reference(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lr: torch.Tensor,
        tau: torch.Tensor,
        w0: torch.Tensor,
        b0: torch.Tensor,
        ln_w: torch.Tensor,
        ln_b: torch.Tensor,
        mini_batch: int = 16,
        ln_residual: bool = True,
        eps: float = 1e-6,
        return_grad_norm: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal TTT-Linear scan in the mini-batch dual form.

    Args:
        q, k, v: (B, heads, N, d) queries, keys, values in scan order.
        lr: (B, heads, N) per-token learning rate (already ``base_lr * sigmoid(.) / d``).
        tau: (mini_batch,) position factor inside a mini-batch (see :func:`token_tau`).
        w0: (B or 1, heads, d, d) initial inner weight; b0: (B or 1, heads, 1, d) initial bias.
        ln_w, ln_b: (heads, d) per-head inner LayerNorm (unused when ``ln_residual=False``).
        mini_batch: tokens per gradient step; a shorter last mini-batch uses ``tau[:r]``.
        return_grad_norm: also return ``||grad_W l_t||_F = ||k_t|| * ||g_t||`` per token, (B, heads, N).
    fp16/bf16 inputs are computed in float32 (state, LayerNorm statistics) and the output cast back.
    Returns:
        (out (B, heads, N, d), grad_norm or None)
    """
    bsz, heads, n, d = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if lr.shape != (bsz, heads, n):
        raise ValueError(f"lr must be (B, heads, N) = {(bsz, heads, n)}, got {tuple(lr.shape)}")
    if tau.shape != (mini_batch,):
        raise ValueError(f"tau must have one entry per mini-batch position ({mini_batch}), got {tuple(tau.shape)}")
    if w0.shape[-3:] != (heads, d, d) or b0.shape[-3:] != (heads, 1, d):
        raise ValueError(f"w0 must be (B|1, {heads}, {d}, {d}) and b0 (B|1, {heads}, 1, {d}); "
                         f"got {tuple(w0.shape)} and {tuple(b0.shape)}")
    out_dtype = q.dtype
    cd = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32  # low precision: fp32 state
    q, k, v, lr, tau = q.to(cd), k.to(cd), v.to(cd), lr.to(cd), tau.to(cd)
    w0, b0, ln_w, ln_b = w0.to(cd), b0.to(cd), ln_w.to(cd), ln_b.to(cd)
    lnw = ln_w.view(1, heads, 1, d)
    lnb = ln_b.view(1, heads, 1, d)
    # full mini-batches form one group, a shorter last one a second; inside a group only the state recursion
    # runs chunk by chunk, the outputs of all its chunks are formed at once afterwards
    w = w0.expand(bsz, heads, d, d)
    b = b0.expand(bsz, heads, 1, d)
    full = n // mini_batch * mini_batch
    groups = [(0, full, mini_batch)] if full else []
    if n > full:
        groups.append((full, n, n - full))
    outs, norms = [], []
    for s, e, c in groups:
        nc = (e - s) // c
        qg = q[:, :, s:e].reshape(bsz, heads, nc, c, d)
        kg = k[:, :, s:e].reshape(bsz, heads, nc, c, d)
        tg = (v[:, :, s:e] - k[:, :, s:e] if ln_residual else v[:, :, s:e]).reshape(bsz, heads, nc, c, d)
        eta = torch.tril(tau[:c, None] * lr[:, :, s:e].reshape(bsz, heads, nc, 1, c))  # eta_ij = tau_i lr_j, j<=i
        eta_last = eta[..., -1, :, None]  # (B, h, nc, c, 1): the last row carries the state on
        ws, bs, gs = [], [], []
        for i in range(nc):
            kc = kg[:, :, i]
            z = kc @ w + b
            g = ln_l2_grad(z, tg[:, :, i], lnw, lnb, eps) if ln_residual else z - tg[:, :, i]
            ws.append(w)
            bs.append(b)
            gs.append(g)
            step = eta_last[:, :, i] * g
            w = w - kc.transpose(-1, -2) @ step
            b = b - step.sum(-2, keepdim=True)
        wg, bg, gg = torch.stack(ws, 2), torch.stack(bs, 2), torch.stack(gs, 2)
        z_bar = qg @ wg + bg - (eta * (qg @ kg.transpose(-1, -2) + 1.0)) @ gg
        o = qg + _layer_norm(z_bar, lnw[:, :, None], lnb[:, :, None], eps) if ln_residual else z_bar
        outs.append(o.reshape(bsz, heads, e - s, d))
        if return_grad_norm:
            norms.append((kg.norm(dim=-1) * gg.norm(dim=-1)).reshape(bsz, heads, e - s))
    out = torch.cat(outs, dim=2).to(out_dtype)
    return out, (torch.cat(norms, dim=2) if return_grad_norm else None)


def ttt_linear_bidir(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        lr: torch.Tensor,
        tau: torch.Tensor,
        w0: torch.Tensor,
        b0: torch.Tensor,
        ln_w: torch.Tensor,
        ln_b: torch.Tensor,
        mini_batch: int = 16,
        ln_residual: bool = True,
        rope_theta: Optional[float] = 10000.0,
        eps: float = 1e-6,
        scan=None,
        return_grad_norm: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward scan + scan of the flipped sequence, summed: ``Z_forth + flip(Z_back)`` (Vision-TTT Eq. 12).

    Both directions run in one call, stacked on the batch axis (2B).  ``w0``/``b0`` are (1 | 2, heads, ...):
    one state shared by both directions, or one per direction (index 0 forward, 1 backward).  Each direction
    forms its mini-batches (and in-chunk RoPE positions, ``rope_theta=None`` disables) in its own order.
    ``scan`` is the single-direction op (default :func:`ttt_linear_reference`).
    Returns (out (B, heads, N, d), grad_norm (2, B, heads, N) in original token order, or None).
    """
    bsz = q.shape[0]
    if w0.shape[0] not in (1, 2) or b0.shape[0] != w0.shape[0]:
        raise ValueError(f"w0/b0 need a leading dim of 1 (shared) or 2 (per direction), got {tuple(w0.shape)}")

    q2 = torch.cat([q, q.flip(2)], dim=0)
    k2 = torch.cat([k, k.flip(2)], dim=0)
    v2 = torch.cat([v, v.flip(2)], dim=0)
    if rope_theta is not None:
        q2, k2 = inner_rope(q2, mini_batch, rope_theta), inner_rope(k2, mini_batch, rope_theta)
    lr2 = torch.cat([lr, lr.flip(2)], dim=0)
    if w0.shape[0] == 2:
        w0 = w0.repeat_interleave(bsz, dim=0)
        b0 = b0.repeat_interleave(bsz, dim=0)
    scan = scan or ttt_linear_reference
    out, gn = scan(q2, k2, v2, lr2, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps, return_grad_norm)
    out = out[:bsz] + out[bsz:].flip(2)
    if gn is not None:
        gn = torch.stack([gn[:bsz], gn[bsz:].flip(2)])
    return out, gn
