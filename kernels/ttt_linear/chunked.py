"""Chunked forward of the TTT-Linear scan (inference without autograd, the grad-norm map, TorchScript scripting).

Same math as ``naive.py``: the bias folded into the state as one extra row, batch and heads one ``bmm`` batch,
everything that does not depend on the state formed for all mini-batches at once, and a Python loop over the
mini-batches of 2 ``bmm``s and the closed-form LayerNorm gradient (ATen's fused LayerNorm kernels).  No autograd
machinery; differentiable by autograd but not lean (training runs ``torch.py``'s recomputing scan).  Same contract
as the recomputing scan (``torch.py``) and the export form (``export.py``): the signatures of the references.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import bidir_inputs as _flipped_inputs
from .common import bidir_outputs, scan_setup

__all__ = ["ttt_linear_chunked", "ttt_linear_bidir_chunked"]


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


def ttt_linear_chunked(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ln_w: Tensor,
                       ln_b: Tensor, mini_batch: int = 16, ln_residual: bool = True, eps: float = 1e-6,
                       return_grad_norm: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Causal TTT-Linear scan in the mini-batch dual form, arguments and result as ``naive.ttt_linear_naive``:
    the bias folded into the state as one extra row (``[k, 1] @ [W; b]``), batch and heads one ``bmm`` batch,
    everything that does not depend on the state (targets, the causal ``eta * (q k^T + 1)`` block,
    ``k * eta_last``) formed for all mini-batches at once; the loop per mini-batch is 2 ``bmm``s and the
    closed-form LayerNorm gradient (ATen's fused LayerNorm kernels).  The outputs are formed inside the loop, so no
    per-mini-batch state is kept in inference.  The Python loop runs once per mini-batch: a traced graph would fix
    the token count, so exporters take ``export.ttt_linear_export`` instead (the switch is ``torch.ttt_linear_torch``).
    """
    out_dtype = q.dtype
    cd, lnw, lnb, w, b = scan_setup(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch)
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


def ttt_linear_bidir_chunked(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                             ln_w: Tensor, ln_b: Tensor, mini_batch: int = 16, ln_residual: bool = True,
                             rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False
                             ) -> Tuple[Tensor, Optional[Tensor]]:
    """Both scan directions with :func:`ttt_linear_chunked`, summed (as ``naive.ttt_linear_bidir_naive``;
    TorchScript-compilable)."""
    q2, k2, v2, lr2, w0, b0 = _flipped_inputs(q, k, v, lr, w0, b0, mini_batch, rope_theta)
    out, gn = ttt_linear_chunked(q2, k2, v2, lr2, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps,
                                 return_grad_norm)
    return bidir_outputs(out, gn, q.shape[0])
