"""Pure-PyTorch reference of TTT-Linear (Sun et al.), mini-batch dual form, as Vision-TTT uses it.

Per head the inner model is ``f(x) = x + LN(x W + b)`` (``ln_residual=True``, ttt-lm) or ``f(x) = x W + b``
(``ln_residual=False``, the paper's Eq. 4).  Token j's loss is ``1/2 ||LN(k_j W + b) - (v_j - k_j)||^2``
(or ``1/2 ||k_j W + b - v_j||^2``).  Inside a mini-batch every gradient is taken at the mini-batch's incoming
state and token i reads ``W_i = W_0 - sum_{j<=i} eta_ij k_j^T g_j`` (inclusive causal mask); the step is
factorised as ``eta_ij = tau_i * lr_j`` (tau by position in the mini-batch, lr per token).  Only one state
``(B, heads, d, d)`` per mini-batch exists at a time; nothing of size B x N x d x d is formed.

Two implementations of the same scan (both TorchScript-compilable, both differentiable by autograd):

- :func:`ttt_linear_reference` (the ``torch`` path on CPU): the bias is folded into the state as one extra row
  (``[k, 1] @ [W; b]``), batch and heads are one ``bmm`` batch, everything that does not depend on the state
  (targets, the causal ``eta * (q k^T + 1)`` block, ``k * eta_last``) is formed for all mini-batches at once, and the
  loop per mini-batch is 2 ``bmm``s and the closed-form LayerNorm gradient (ATen's fused LayerNorm kernels); outputs are formed inside the loop,
  so no per-mini-batch state is kept in inference.
- :func:`ttt_linear_naive` (``torch_naive``): the plain form, the per-mini-batch states stacked and the outputs
  formed afterwards.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..utils import compute_dtype as _compute_dtype  # fp16/bf16: state and LN statistics in float32

__all__ = ["ttt_linear_reference", "ttt_linear_naive", "ttt_linear_bidir", "ttt_linear_bidir_reference",
           "ln_l2_grad", "inner_rope", "token_tau"]


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

    Rotate-half layout: channel p pairs with channel p + d/2.  The angle table has only ``b x d/2`` entries (built
    in float64, then cast); it is gathered to the N positions.
    """
    n, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ValueError(f"inner RoPE needs an even head dim, got {d}")
    half = d // 2
    freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d))
    ang = torch.arange(min(n, mini_batch), device=x.device, dtype=torch.float64)[:, None] * freq[None, :]
    pos = torch.arange(n, device=x.device) % mini_batch
    cos, sin = ang.cos().to(x.dtype)[pos], ang.sin().to(x.dtype)[pos]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([torch.addcmul(x1 * cos, x2, sin, value=-1.0), torch.addcmul(x2 * cos, x1, sin)], dim=-1)


def _check_scan_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                     w0: torch.Tensor, b0: torch.Tensor, mini_batch: int) -> None:
    bsz, heads, n, d = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    if list(k.shape) != list(q.shape) or list(v.shape) != list(q.shape):
        raise ValueError(f"q, k, v must have the same shape, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if list(lr.shape) != [bsz, heads, n]:
        raise ValueError(f"lr must be (B, heads, N) = {[bsz, heads, n]}, got {list(lr.shape)}")
    if list(tau.shape) != [mini_batch]:
        raise ValueError(f"tau must have one entry per mini-batch position ({mini_batch}), got {list(tau.shape)}")
    if w0.dim() != 4 or b0.dim() != 4 or list(w0.shape[1:]) != [heads, d, d] or list(b0.shape[1:]) != [heads, 1, d]:
        raise ValueError(f"w0 must be (B|1, {heads}, {d}, {d}) and b0 (B|1, {heads}, 1, {d}); "
                         f"got {list(w0.shape)} and {list(b0.shape)}")


def _scan_setup(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                w0: torch.Tensor, b0: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, mini_batch: int
                ) -> Tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks the scan's arguments; returns the compute dtype and, in it, ``ln_w``, ``ln_b`` as (1, heads, 1, d)
    and the initial state ``w0`` (B, heads, d, d), ``b0`` (B, heads, 1, d) expanded over the batch."""
    _check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch)
    bsz, heads, d = q.shape[0], q.shape[1], q.shape[3]
    cd = _compute_dtype(q.dtype)
    return (cd, ln_w.to(cd).reshape(1, heads, 1, d), ln_b.to(cd).reshape(1, heads, 1, d),
            w0.to(cd).expand(bsz, heads, d, d), b0.to(cd).expand(bsz, heads, 1, d))


def _ln_grad(z: torch.Tensor, c: torch.Tensor, lnw2: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`ln_l2_grad` with ``c = (ln_b - target) * ln_w`` and ``lnw2 = ln_w^2`` precomputed, in three ops: the
    gradient is LayerNorm's own backward applied to ``gx = c + lnw2 * x_hat``, so ATen's fused LayerNorm forward and
    backward kernels form it (the scan runs this once per mini-batch, where the op count sets the time).  The
    kernels centre ``z`` themselves: a rounding-level row mean left in would be fed back, with the same sign, into
    every later state and grow geometrically over the mini-batches.  Autograd through it is exact: the double
    backward of ``native_layer_norm_backward`` differentiates through the statistics (given detached)."""
    shape = [z.shape[-1]]
    x_hat, mean, rstd = torch.native_layer_norm(z, shape, None, None, eps)
    gx = torch.addcmul(c, x_hat, lnw2)
    return torch.ops.aten.native_layer_norm_backward(gx, z, shape, mean.detach(), rstd.detach(), None, None,
                                                     [True, False, False])[0]


def _minibatch_step(state: torch.Tensor, kq: torch.Tensor, tgt: torch.Tensor, kel: torch.Tensor,
                    lnw2: Optional[torch.Tensor], eps: float, c: int, shared: bool, update: bool = True,
                    inplace: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mini-batch of the dual form (shared by the chunked scan and the export loop): z = k S and q S from one
    bmm of [k; q] (or of k alone when q = k), the inner gradient g, and the next state S + kel g (``update``).
    ``inplace`` (no autograd; ``state`` is the scan's own buffer): the update accumulates into ``state``."""
    z = torch.bmm(kq, state)
    o = z
    if not shared:
        z, o = z[:, :c], z[:, c:]
    g = _ln_grad(z, tgt, lnw2, eps) if lnw2 is not None else z - tgt
    if not update:
        return o, g, state
    # out=state, not baddbmm_: FlopCounterMode (timm's and our GMAC counts) does not count the in-place overloads
    return o, g, (torch.baddbmm(state, kel, g, out=state) if inplace else torch.baddbmm(state, kel, g))


def _scan_output(q: torch.Tensor, z_bar: torch.Tensor, lnw: torch.Tensor, lnb: torch.Tensor, eps: float,
                 ln_residual: bool) -> torch.Tensor:
    """The scan's output from z_bar: q + LN(z_bar) (the residual inner model) or z_bar itself."""
    if not ln_residual:
        return z_bar
    return torch.addcmul(q + lnb, F.layer_norm(z_bar, [z_bar.shape[-1]], eps=eps), lnw)


def _scan_chunks(qa: torch.Tensor, ka: torch.Tensor, tgt: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                 state: torch.Tensor, lnw2: Optional[torch.Tensor], eps: float, keep_grads: bool, carry: bool,
                 shared: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Mini-batches of one length ``c = tau.shape[0]``.

    qa, ka: (BH, nc * c, d + 1) with a trailing 1; tgt: (BH, nc * c, d) the target (or, with ``lnw2``, the
    LayerNorm-gradient constant); lr: (BH, nc * c);
    state: (BH, d + 1, d) = [W; b].
    ``shared``: q = k (Vittt's default), then one bmm gives both z = k S and the output's q S.
    Returns z_bar (BH, nc * c, d), the inner gradients g (if ``keep_grads``) and the outgoing state (if ``carry``).
    """
    bh, m, da = qa.shape
    d = da - 1
    c = tau.shape[0]
    nc = m // c
    qc = qa.reshape(bh, nc, c, da)
    kc = ka.reshape(bh, nc, c, da)
    lrc = lr.reshape(bh, nc, 1, c)
    # state-independent parts, all mini-batches at once: -eta * (q k^T + 1) (causal), -k_j eta_{c,j}, [k; q]
    attn = torch.matmul(qc, kc.transpose(-1, -2)) * torch.tril(-tau[:, None] * lrc)
    kel = (kc * (-tau[c - 1] * lrc).transpose(-1, -2)).transpose(-1, -2).unbind(1)  # (BH, d+1, c) each
    kq = kc.unbind(1) if shared else torch.cat([kc, qc], dim=2).unbind(1)
    tgt_l = tgt.reshape(bh, nc, c, d).unbind(1)
    # without autograd the state and the output are the scan's own buffers: update them in place (an out-of-place
    # baddbmm first copies its input into a new tensor, once per mini-batch)
    inplace = not (torch.is_grad_enabled() and (qa.requires_grad or ka.requires_grad or tgt.requires_grad
                                                or lr.requires_grad or tau.requires_grad or state.requires_grad))
    if inplace:
        state = state.clone()  # the caller's state (the initial one, or the carried one) is left as it was
    outs: List[torch.Tensor] = []
    grads: List[torch.Tensor] = []
    for i in range(nc):
        o, g, state = _minibatch_step(state, kq[i], tgt_l[i], kel[i], lnw2, eps, c, shared, carry or i < nc - 1,
                                      inplace)
        outs.append(o)
        grads.append(g)
    # the in-mini-batch part of every output at once: z_bar_i = q_i S - (eta * (q k^T + 1)) g
    gs = torch.stack(grads, 1)
    qs = torch.stack(outs, 1).reshape(bh * nc, c, d)
    a2, g2 = attn.reshape(bh * nc, c, c), gs.reshape(bh * nc, c, d)
    z_bar = torch.baddbmm(qs, a2, g2, out=qs) if inplace else torch.baddbmm(qs, a2, g2)
    return z_bar.reshape(bh, m, d), (gs.reshape(bh, m, d) if keep_grads else None), state


def _scan_loop(qa: torch.Tensor, ka: torch.Tensor, tgt: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
               state: torch.Tensor, lnw2: Optional[torch.Tensor], eps: float, shared: bool) -> torch.Tensor:
    """:func:`_scan_chunks` over every mini-batch as one ``scan`` higher-order op (a loop op: ONNX ``Scan``), so an
    exported graph keeps the token count symbolic instead of unrolling a Python loop fixed to the traced size.

    The sequence is padded at its end to whole mini-batches with zero learning rate: a padded token comes after
    every real token of its mini-batch (the mask is causal) and its step is scaled by lr = 0, so no real output
    changes; the padded outputs are dropped.  Returns z_bar (BH, N, d).
    """
    from torch._higher_order_ops.scan import scan
    bh, n, da = qa.shape[0], qa.shape[1], qa.shape[2]
    d = da - 1
    c = tau.shape[0]
    pad = (c - n % c) % c
    nc = (n + pad) // c

    def chunks(t: torch.Tensor) -> torch.Tensor:  # (BH, N, ...) -> (n_mb, BH, c, ...)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 3 else F.pad(t, (0, pad))
        return t.reshape(bh, nc, c, *t.shape[2:]).transpose(0, 1)

    causal = torch.tril(torch.ones(c, c, dtype=qa.dtype, device=qa.device)) * -tau[:, None]

    def step(st: torch.Tensor, x: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        kc, tc, lrc = x[0], x[1], x[2]
        qc = kc if shared else x[3]
        kel = (kc * (-tau[c - 1] * lrc)[:, :, None]).transpose(1, 2)
        o, g, st = _minibatch_step(st, kc if shared else torch.cat([kc, qc], 1), tc, kel, lnw2, eps, c, shared)
        attn = torch.bmm(qc, kc.transpose(1, 2)) * (causal * lrc[:, None, :])
        return st, torch.baddbmm(o, attn, g)

    xs = [chunks(ka), chunks(tgt), chunks(lr)] + ([] if shared else [chunks(qa)])
    _, z_bar = scan(step, state, xs)
    return z_bar.transpose(0, 1).reshape(bh, nc * c, d)[:, :n]


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
    out_dtype = q.dtype
    cd, lnw, lnb, w, b = _scan_setup(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch)
    bsz, heads, n, d = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    bh = bsz * heads
    shared = q is k
    q, lr, tau = q.to(cd), lr.to(cd).reshape(bh, n), tau.to(cd)
    k = q if shared else k.to(cd)
    one = torch.ones(bsz, heads, n, 1, device=q.device, dtype=cd)
    ka = torch.cat([k, one], -1).reshape(bh, n, d + 1)
    qa = ka if shared else torch.cat([q, one], -1).reshape(bh, n, d + 1)
    state = torch.cat([w, b], 2).reshape(bh, d + 1, d)
    lnw2: Optional[torch.Tensor] = None
    if ln_residual:
        tgt = ((lnb - (v.to(cd) - k)) * lnw).reshape(bh, n, d)
        lnw2 = (lnw * lnw).expand(bsz, heads, 1, d).reshape(bh, 1, d)
    else:
        tgt = v.to(cd).reshape(bh, n, d)
    if not torch.jit.is_scripting():  # (TorchScript skips this block)
        if torch.compiler.is_exporting() and not return_grad_norm:  # one loop op, the token count stays symbolic
            z_bar = _scan_loop(qa, ka, tgt, lr, tau, state, lnw2, eps, shared).reshape(bsz, heads, n, d)
            return _scan_output(q, z_bar, lnw, lnb, eps, ln_residual).to(out_dtype), None
    full = n // mini_batch * mini_batch
    parts: List[torch.Tensor] = []
    grads: List[torch.Tensor] = []
    if full > 0:
        zb, g, state = _scan_chunks(qa[:, :full], ka[:, :full], tgt[:, :full], lr[:, :full], tau, state, lnw2, eps,
                                    return_grad_norm, n > full, shared)
        parts.append(zb)
        if g is not None:
            grads.append(g)
    if n > full:
        zb, g, state = _scan_chunks(qa[:, full:], ka[:, full:], tgt[:, full:], lr[:, full:], tau[:n - full], state,
                                    lnw2, eps, return_grad_norm, False, shared)
        parts.append(zb)
        if g is not None:
            grads.append(g)
    z_bar = (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).reshape(bsz, heads, n, d)
    out = _scan_output(q, z_bar, lnw, lnb, eps, ln_residual)
    gn: Optional[torch.Tensor] = None
    if return_grad_norm:
        gg = grads[0] if len(grads) == 1 else torch.cat(grads, 1)
        gn = torch.linalg.vector_norm(k, dim=-1) * torch.linalg.vector_norm(gg.reshape(bsz, heads, n, d), dim=-1)
    return out.to(out_dtype), gn


def ttt_linear_naive(
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
    """The same scan written plainly (arguments as :func:`ttt_linear_reference`): per mini-batch the state
    recursion; the states of all mini-batches are stacked and the outputs formed from them afterwards."""
    out_dtype = q.dtype
    cd, lnw, lnb, w, b = _scan_setup(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch)
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


def _flip_both(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (2B, ...): the sequence (dim 2) and its reverse, stacked on the batch axis."""
    return torch.cat([x, x.flip(2)], dim=0)


def bidir_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, w0: torch.Tensor,
                 b0: torch.Tensor, mini_batch: int, rope_theta: Optional[float]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both scan directions stacked on the batch axis (2B), in-chunk RoPE applied, W0/b0 per direction."""
    bsz = q.shape[0]
    if (w0.shape[0] != 1 and w0.shape[0] != 2) or b0.shape[0] != w0.shape[0]:
        raise ValueError(f"w0/b0 need a leading dim of 1 (shared) or 2 (per direction), got {list(w0.shape)}")
    q2, v2 = _flip_both(q), _flip_both(v)
    if rope_theta is not None:
        q2 = inner_rope(q2, mini_batch, rope_theta)
    k2 = q2  # shared q = k: formed once (the scan then also skips the second projection)
    if k is not q:
        k2 = _flip_both(k)
        if rope_theta is not None:
            k2 = inner_rope(k2, mini_batch, rope_theta)
    if w0.shape[0] == 2:
        w0 = w0.repeat_interleave(bsz, dim=0)
        b0 = b0.repeat_interleave(bsz, dim=0)
    return q2, k2, v2, _flip_both(lr), w0, b0


def bidir_outputs(out: torch.Tensor, gn: Optional[torch.Tensor], bsz: int
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum of the forward scan and the re-flipped backward scan; grad norms stacked (2, B, heads, N)."""
    out = out[:bsz] + out[bsz:].flip(2)
    if gn is not None:
        gn = torch.stack([gn[:bsz], gn[bsz:].flip(2)])
    return out, gn


def ttt_linear_bidir_reference(
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
        return_grad_norm: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`ttt_linear_bidir` with the scan fixed to :func:`ttt_linear_reference` (TorchScript-compilable)."""
    q2, k2, v2, lr2, w0, b0 = bidir_inputs(q, k, v, lr, w0, b0, mini_batch, rope_theta)
    out, gn = ttt_linear_reference(q2, k2, v2, lr2, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps,
                                   return_grad_norm)
    return bidir_outputs(out, gn, q.shape[0])


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
    q2, k2, v2, lr2, w0, b0 = bidir_inputs(q, k, v, lr, w0, b0, mini_batch, rope_theta)
    scan = scan or ttt_linear_reference
    out, gn = scan(q2, k2, v2, lr2, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps, return_grad_norm)
    return bidir_outputs(out, gn, q.shape[0])
