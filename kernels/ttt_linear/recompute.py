"""Lean PyTorch path of the TTT-Linear scan: analytic backward that recomputes instead of storing.

Same math as ``reference.py``.  The forward keeps only the incoming state (W, b) at coarse checkpoints (every ``ceil(sqrt(N / mini_batch))``-th
mini-batch, fp32 or float64); the backward walks the segments in reverse, recomputes the states inside a segment
from its checkpoint, then walks its mini-batches in reverse, recomputing z, the inner gradient G and the dual-form
output from the state, and carries (dW, db) backwards.

One mini-batch (c tokens, incoming state W, b; eta = tril(tau_i lr_j); e_j = tau_{c-1} lr_j):
    Z = K W + b,  G = lnl2(Z, T) (T = V - K, or G = Z - V without the LayerNorm)
    A = eta * (Q K^T + 1),  Zb = Q W + b - A G,  O = Q + LN(Zb) (or Zb)
    W' = W - K^T (e G),  b' = b - sum_j e_j G_j
Backward (dO, and dW', db' of the outgoing state):
    dZb = LNbwd(dO),  dQ = dO + dZb W^T + dS K,  dW = dW' + Q^T dZb + K^T dZ,  db = db' + sum(dZb + dZ)
    dA = -dZb G^T (masked),  deta = dA (Q K^T + 1),  dS = dA eta,  dG = -A^T dZb - e (K dW' + db')
    de = -rowsum((K dW' + db') G),  dlr_j = sum_i deta_ij tau_i + de_j tau_{c-1},  dtau likewise
    dZ, dT = lnl2bwd(dG),  dK = dZ W^T + dS^T Q - (e G) dW'^T (- dT),  dV = dT

General contract shared with the Triton kernels and the ``ttt_zoo::ttt_linear_*`` ops (``ndir`` = 1 or 2
directions; direction 1 scans the sequence reversed):
    q, k: (R, B, H, N, d) with R = 1 (same for both directions) or ndir;  v: (B, H, N, d);  lr: (B, H, N)
    tau: (mini_batch,);  w0: (Rw, Bw, H, d, d), b0: (Rw, Bw, H, 1, d) with Rw in {1, ndir}, Bw in {1, B}
    ln_w, ln_b: (H, d)
    fwd -> out (B, H, N, d) (the directions summed, original token order), states (ndir B, H, n_ck, d + 1, d):
        the incoming (W; b) of every ``ck``-th mini-batch, ``ck = ceil(sqrt(n_mb))``, ``n_ck = ceil(n_mb / ck)``
        (n_mb = ceil(N / mini_batch)); the backward recomputes the states inside a segment of ck mini-batches.
"""
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .reference import ttt_linear_bidir, ttt_linear_reference

__all__ = ["scan_fwd", "scan_bwd", "TTTLinearScan", "ttt_linear_torch", "ttt_linear_bidir_torch", "rope_at",
           "bidir_inputs", "single_inputs", "ttt_linear_bidir_naive", "ckpt_every"]


def _cd(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _ln(z: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    mu = z.mean(-1, keepdim=True)
    std = (z.var(-1, keepdim=True, unbiased=False) + eps).sqrt()
    return (z - mu) / std, std


def _ln_bwd(dxh: Tensor, xh: Tensor, std: Tensor) -> Tensor:
    """dz for xh = (z - mean) / std (also the closed-form LN gradient operator itself: it is symmetric)."""
    return (dxh - dxh.mean(-1, keepdim=True) - xh * (dxh * xh).mean(-1, keepdim=True)) / std


def _seq(x: Tensor, ndir: int, per_dir: bool) -> Tensor:
    """Stack the directions on the batch axis in scan order; ``per_dir``: x has a leading direction axis."""
    parts = []
    for i in range(ndir):
        xi = x[min(i, x.shape[0] - 1)] if per_dir else x
        parts.append(xi.flip(2) if i else xi)
    return torch.cat(parts, 0)


def _unseq(x: Tensor, ndir: int) -> List[Tensor]:
    b = x.shape[0] // ndir
    return [x[i * b:(i + 1) * b].flip(2) if i else x[:b] for i in range(ndir)]


def _state0(w0: Tensor, b0: Tensor, ndir: int, bsz: int, cd: torch.dtype) -> Tuple[Tensor, Tensor]:
    h, d = w0.shape[2], w0.shape[3]
    w = torch.cat([w0[min(i, w0.shape[0] - 1)].expand(bsz, h, d, d) for i in range(ndir)], 0)
    b = torch.cat([b0[min(i, b0.shape[0] - 1)].expand(bsz, h, 1, d) for i in range(ndir)], 0)
    return w.to(cd), b.to(cd)


def ckpt_every(n_mb: int) -> int:
    """Mini-batches per saved state: ceil(sqrt(n_mb)), so saved + recomputed states are ~2 sqrt(N / b)."""
    return max(1, math.ceil(math.sqrt(n_mb)))


def _chunks(n: int, mb: int) -> List[Tuple[int, int]]:
    return [(s, min(s + mb, n)) for s in range(0, n, mb)]


def _inner_grad(z: Tensor, t: Tensor, lnw: Tensor, lnb: Tensor, ln_residual: bool, eps: float) -> Tensor:
    if not ln_residual:
        return z - t
    xh, std = _ln(z, eps)
    return _ln_bwd((lnw * xh + lnb - t) * lnw, xh, std)


def scan_fwd(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ln_w: Tensor,
             ln_b: Tensor, ndir: int, mini_batch: int, ln_residual: bool, eps: float,
             save_states: bool) -> Tuple[Tensor, Tensor]:
    """Forward of the general contract (module docstring); states is empty unless ``save_states``."""
    _, bsz, h, n, d = q.shape
    cd = _cd(q.dtype)
    qs, ks = _seq(q.to(cd), ndir, True), _seq(k.to(cd), ndir, True)
    vs, lrs = _seq(v.to(cd), ndir, False), _seq(lr.to(cd), ndir, False)
    ts = vs - ks if ln_residual else vs
    tau = tau.to(cd)
    lnw, lnb = ln_w.to(cd).view(1, h, 1, d), ln_b.to(cd).view(1, h, 1, d)
    w, b = _state0(w0, b0, ndir, bsz, cd)
    outs, states = [], []
    ck = ckpt_every(-(-n // mini_batch))
    for i, (s, e) in enumerate(_chunks(n, mini_batch)):
        c = e - s
        kc, qc, lc = ks[:, :, s:e], qs[:, :, s:e], lrs[:, :, s:e]
        if save_states and i % ck == 0:
            states.append(torch.cat([w, b], 2))
        g = _inner_grad(kc @ w + b, ts[:, :, s:e], lnw, lnb, ln_residual, eps)
        eta = torch.tril(tau[:c, None] * lc[:, :, None, :])
        zb = qc @ w + b - (eta * (qc @ kc.transpose(-1, -2) + 1.0)) @ g
        if ln_residual:
            xh, _ = _ln(zb, eps)
            zb = qc + xh * lnw + lnb
        outs.append(zb)
        step = (tau[c - 1] * lc)[..., None] * g
        w = w - kc.transpose(-1, -2) @ step
        b = b - step.sum(-2, keepdim=True)
    out = sum(_unseq(torch.cat(outs, 2), ndir)).to(q.dtype)
    st = torch.stack(states, 2) if save_states else q.new_empty(0, dtype=cd)
    return out, st


def _reduce_w(dw: Tensor, like: Tensor, ndir: int) -> Tensor:
    """(ndir B, H, ...) per-sequence gradient -> the shape of w0 / b0 (Rw, Bw, H, ...)."""
    dw = dw.reshape(ndir, -1, *dw.shape[1:])
    if like.shape[0] == 1:
        dw = dw.sum(0, keepdim=True)
    if like.shape[1] == 1:
        dw = dw.sum(1, keepdim=True)
    return dw


def scan_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
             ln_w: Tensor, ln_b: Tensor, states: Tensor, ndir: int, mini_batch: int, ln_residual: bool,
             eps: float) -> List[Tensor]:
    """Backward of :func:`scan_fwd` from the saved per-mini-batch states.

    Returns [dq, dk, dv, dlr, dtau, dw0, db0, dln_w, dln_b] in the shapes (and dtypes) of the inputs.
    """
    _, bsz, h, n, d = q.shape
    cd = _cd(q.dtype)
    qs, ks = _seq(q.to(cd), ndir, True), _seq(k.to(cd), ndir, True)
    vs, lrs = _seq(v.to(cd), ndir, False), _seq(lr.to(cd), ndir, False)
    dos = _seq(do.to(cd), ndir, False)
    ts = vs - ks if ln_residual else vs
    tau_c = tau.to(cd)
    lnw, lnb = ln_w.to(cd).view(1, h, 1, d), ln_b.to(cd).view(1, h, 1, d)
    states = states.to(cd)
    dq, dk, dv, dlr = torch.zeros_like(qs), torch.zeros_like(ks), torch.zeros_like(vs), torch.zeros_like(lrs)
    dtau = torch.zeros_like(tau_c)
    dlnw = torch.zeros(h, d, dtype=cd, device=q.device)
    dlnb = torch.zeros_like(dlnw)
    dw = torch.zeros(qs.shape[0], h, d, d, dtype=cd, device=q.device)
    db = torch.zeros(qs.shape[0], h, 1, d, dtype=cd, device=q.device)
    chunks = _chunks(n, mini_batch)
    ck = ckpt_every(len(chunks))
    seg_states: List[Tuple[Tensor, Tensor]] = []
    for i in range(len(chunks) - 1, -1, -1):
        s, e = chunks[i]
        c = e - s
        if not seg_states:  # entering a segment from its end: recompute its states from the checkpoint
            lo = i // ck * ck
            w, b = states[:, :, i // ck, :d], states[:, :, i // ck, d:]
            for j in range(lo, i + 1):
                seg_states.append((w, b))
                if j < i:
                    sj, ej = chunks[j]
                    g = _inner_grad(ks[:, :, sj:ej] @ w + b, ts[:, :, sj:ej], lnw, lnb, ln_residual, eps)
                    step = (tau_c[ej - sj - 1] * lrs[:, :, sj:ej])[..., None] * g
                    w = w - ks[:, :, sj:ej].transpose(-1, -2) @ step
                    b = b - step.sum(-2, keepdim=True)
        w, b = seg_states.pop()
        kc, qc, tc, lc, doc = ks[:, :, s:e], qs[:, :, s:e], ts[:, :, s:e], lrs[:, :, s:e], dos[:, :, s:e]
        tu = tau_c[:c]
        # recompute the mini-batch's forward
        z = kc @ w + b
        if ln_residual:
            xh, std = _ln(z, eps)
            y = lnw * xh + lnb - tc
            gx = y * lnw
            g = _ln_bwd(gx, xh, std)
        else:
            g = z - tc
        eta = torch.tril(tu[:, None] * lc[:, :, None, :])
        sqk = qc @ kc.transpose(-1, -2) + 1.0
        a = eta * sqk
        zb = qc @ w + b - a @ g
        el = tu[c - 1] * lc
        # output LayerNorm + residual
        if ln_residual:
            xh2, std2 = _ln(zb, eps)
            dlnw += (doc * xh2).sum((0, 2))
            dlnb += doc.sum((0, 2))
            dzb = _ln_bwd(doc * lnw, xh2, std2)
            dqc = doc.clone()
        else:
            dzb = doc
            dqc = torch.zeros_like(doc)
        # dual-form output
        dqc += dzb @ w.transpose(-1, -2)
        da = torch.tril(-dzb @ g.transpose(-1, -2))
        deta = da * sqk
        dsq = da * eta
        dqc += dsq @ kc
        dkc = dsq.transpose(-1, -2) @ qc
        dg = -a.transpose(-1, -2) @ dzb
        # the state update W' = W - K^T (e G), b' = b - sum e G, with (dw, db) the outgoing state's gradient
        p = kc @ dw + db
        dg -= el[..., None] * p
        de = -(p * g).sum(-1)
        dkc -= (el[..., None] * g) @ dw.transpose(-1, -2)
        dlr[:, :, s:e] = (deta * tu[:, None]).sum(-2) + de * tu[c - 1]
        dtau[:c] += (deta * lc[:, :, None, :]).sum((0, 1, 3))
        dtau[c - 1] += (de * lc).sum()
        # the inner gradient G(Z, T)
        if ln_residual:
            dgx = _ln_bwd(dg, xh, std)
            dy = dgx * lnw
            dlnw += (dgx * y + dy * xh).sum((0, 2))
            dlnb += dy.sum((0, 2))
            dt = -dy
            m = (gx * xh).mean(-1, keepdim=True)
            dxh = dy * lnw - (m * dg + gx * (dg * xh).mean(-1, keepdim=True)) / std
            dz = _ln_bwd(dxh, xh, std) - (dg * g).sum(-1, keepdim=True) * xh / (d * std)
            dkc -= dt
        else:
            dz = dg
            dt = -dg
        dkc += dz @ w.transpose(-1, -2)
        dq[:, :, s:e], dk[:, :, s:e], dv[:, :, s:e] = dqc, dkc, dt
        dw = dw + qc.transpose(-1, -2) @ dzb + kc.transpose(-1, -2) @ dz
        db = db + dzb.sum(-2, keepdim=True) + dz.sum(-2, keepdim=True)
    dqs, dks = torch.stack(_unseq(dq, ndir)), torch.stack(_unseq(dk, ndir))
    if q.shape[0] == 1:
        dqs = dqs.sum(0, keepdim=True)
    if k.shape[0] == 1:
        dks = dks.sum(0, keepdim=True)
    dvs, dlrs = sum(_unseq(dv, ndir)), sum(_unseq(dlr, ndir))
    return [dqs.to(q.dtype), dks.to(k.dtype), dvs.to(v.dtype), dlrs.to(lr.dtype), dtau.to(tau.dtype),
            _reduce_w(dw, w0, ndir).to(w0.dtype), _reduce_w(db, b0, ndir).to(b0.dtype),
            dlnw.to(ln_w.dtype), dlnb.to(ln_b.dtype)]


class TTTLinearScan(torch.autograd.Function):
    """The scan with the recomputing backward; autograd stores the inputs and the per-mini-batch states."""

    @staticmethod
    def forward(ctx, q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps):
        save = any(ctx.needs_input_grad[:9])
        out, st = scan_fwd(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save)
        ctx.save_for_backward(q, k, v, lr, tau, w0, b0, ln_w, ln_b, st)
        ctx.cfg = (ndir, mini_batch, ln_residual, eps)
        return out

    @staticmethod
    def backward(ctx, do):
        grads = scan_bwd(do.contiguous(), *ctx.saved_tensors, *ctx.cfg)
        return (*grads, None, None, None, None)


def rope_at(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """In-chunk RoPE (rotate-half, as :func:`inner_rope`) at explicit positions ``pos: (N,)``."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"inner RoPE needs an even head dim, got {d}")
    freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d))
    ang = pos.to(torch.float64)[:, None] * freq[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def bidir_inputs(q: Tensor, k: Tensor, w0: Tensor, b0: Tensor, mini_batch: int, rope_theta: Optional[float]
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """General-contract inputs of the bidirectional scan, in ORIGINAL token order (no flipped copies).

    With RoPE each direction needs its own rotated q, k (position ``t mod b`` forward, ``(N-1-t) mod b`` for the
    reversed scan), stacked as (2, B, H, N, d); without RoPE q, k get a broadcast leading axis of 1.
    """
    if w0.shape[0] not in (1, 2) or b0.shape[0] != w0.shape[0]:
        raise ValueError(f"w0/b0 need a leading dim of 1 (shared) or 2 (per direction), got {tuple(w0.shape)}")
    if rope_theta is not None:
        n = q.shape[2]
        t = torch.arange(n, device=q.device)
        pf, pb = t % mini_batch, (n - 1 - t) % mini_batch
        q2 = torch.stack([rope_at(q, pf, rope_theta), rope_at(q, pb, rope_theta)])
        k2 = q2 if k is q else torch.stack([rope_at(k, pf, rope_theta), rope_at(k, pb, rope_theta)])
    else:
        q2, k2 = q[None], k[None]
    return q2, k2, w0[:, None], b0[:, None]


def single_inputs(q: Tensor, k: Tensor, w0: Tensor, b0: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """General-contract inputs of the one-direction scan: w0 (B|1, H, d, d) -> (1, B|1, H, d, d)."""
    if w0.shape[0] not in (1, q.shape[0]) or b0.shape[0] != w0.shape[0]:
        raise ValueError(f"w0/b0 need a leading dim of 1 or the batch size {q.shape[0]}, got {tuple(w0.shape)}")
    return q[None], k[None], w0[None], b0[None]


def ttt_linear_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                     eps: float = 1e-6, return_grad_norm: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Causal scan, same signature as :func:`ttt_linear_reference`.

    Inference (no gradient needed) and the grad-norm map run the reference itself (its forward is the faster one).
    """
    if return_grad_norm or not _needs_grad(q, k, v, lr, tau, w0, b0, ln_w, ln_b):
        return ttt_linear_reference(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps, True)
    _check(q, k, v, lr, tau, w0, b0, mini_batch)
    q1, k1, w1, b1 = single_inputs(q, k, w0, b0)
    return TTTLinearScan.apply(q1, k1, v, lr, tau, w1, b1, ln_w, ln_b, 1, mini_batch, ln_residual, eps), None


def ttt_linear_bidir_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                           rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False
                           ) -> Tuple[Tensor, Optional[Tensor]]:
    """Bidirectional scan (both directions in one batched pass), same signature as the reference's.

    Inference (no gradient needed) and the grad-norm map run the reference itself (its forward is the faster one).
    """
    if return_grad_norm or not _needs_grad(q, k, v, lr, tau, w0, b0, ln_w, ln_b):
        return ttt_linear_bidir(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, rope_theta, eps,
                                return_grad_norm=return_grad_norm)
    _check(q, k, v, lr, tau, w0, b0, mini_batch)
    q2, k2, w2, b2 = bidir_inputs(q, k, w0, b0, mini_batch, rope_theta)
    return TTTLinearScan.apply(q2, k2, v, lr, tau, w2, b2, ln_w, ln_b, 2, mini_batch, ln_residual, eps), None


def ttt_linear_bidir_naive(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                           rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False
                           ) -> Tuple[Tensor, Optional[Tensor]]:
    """The reference bidirectional scan (flipped copies, plain autograd); the ``torch_naive`` backend."""
    return ttt_linear_bidir(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, rope_theta, eps,
                            scan=ttt_linear_reference, return_grad_norm=return_grad_norm)


def _needs_grad(*ts: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _check(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, mini_batch: int) -> None:
    bsz, heads, n, d = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if lr.shape != (bsz, heads, n):
        raise ValueError(f"lr must be (B, heads, N) = {(bsz, heads, n)}, got {tuple(lr.shape)}")
    if tau.shape != (mini_batch,):
        raise ValueError(f"tau must have one entry per mini-batch position ({mini_batch}), got {tuple(tau.shape)}")
    if w0.dim() != 4 or w0.shape[-3:] != (heads, d, d) or b0.dim() != 4 or b0.shape[-3:] != (heads, 1, d):
        raise ValueError(f"w0 must be (B|1|2, {heads}, {d}, {d}) and b0 (B|1|2, {heads}, 1, {d}); "
                         f"got {tuple(w0.shape)} and {tuple(b0.shape)}")

