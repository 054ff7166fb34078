"""The ``torch`` backend of the TTT-Linear scan: the recomputing scan (training), and the one switch between the
three PyTorch algorithms (``torch_algorithm``, which ``ttt_linear.choose`` asks), each in its own file with the same contract (the signatures of ``naive.py``):

- training (a gradient needed, eager): this file's recomputing scan, an autograd.Function with an analytic
  backward (below);
- inference and the grad-norm map: ``chunked.py`` (batched over mini-batches, a Python loop, no autograd machinery);
- export (``backend.exporting()``: torch.export, torch.jit.trace or timm's ``exportable`` flag): ``export.py``, a
  loop op whose trip count follows the token count (both ONNX exporters), no autograd.Function, autograd on or off.

The recomputing scan: analytic backward that recomputes instead of storing.

Same math as ``naive.py``.  The forward keeps only the incoming state S = [W; b] at coarse checkpoints (every
``ckpt_every(n_mb)``-th mini-batch, fp32 or float64).  The state is one (d + 1) x d matrix (the bias its last row,
``[k, 1] S = k W + b``) and the update's factor ``e_j [k_j, 1]`` is formed for all tokens at once, so the only loop
over mini-batches, forward and in the backward's recompute, is the recurrence itself: one ``bmm``, the inner
gradient (three fused LayerNorm ops) and one ``baddbmm`` per mini-batch.  The backward walks the checkpoint
segments in reverse: it recomputes the segment's states from its checkpoint, recomputes z, the inner gradient G
and the dual-form output batched over the segment's mini-batches, and runs only the (dW, db) recursion (through
the inner LayerNorm gradient, not linear) one mini-batch at a time.  Peak memory per (batch, head): ~2 x 32 states
of (d + 1) x d plus O(N d) activations; nothing of size N x d x d.

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
from functools import wraps
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..backend import exporting, needs_grad
from ..rope import rope_1d, rope_1d_tables
from ..utils import compute_dtype as _cd
from ..utils import no_autocast as _no_autocast  # the scan chooses its own precision (fp32 state)
from .common import check_bidir_state, check_scan_args
from .chunked import _ln_grad, ttt_linear_bidir_chunked, ttt_linear_chunked
from .export import ttt_linear_bidir_export, ttt_linear_export

__all__ = ["scan_fwd", "scan_bwd", "TTTLinearScan", "TTTLinearRopeScan", "ttt_linear_torch", "ttt_linear_bidir_torch",
           "ttt_linear_scan", "ttt_linear_bidir_scan", "torch_algorithm",
           "bidir_inputs", "single_inputs", "ckpt_every", "ttt_linear_chunked", "ttt_linear_bidir_chunked"]


def _ln(z: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    """x_hat = (z - mean) * rstd over the last dim, with mean and rstd (ATen's fused LayerNorm kernel: one op)."""
    return torch.native_layer_norm(z, [z.shape[-1]], None, None, eps)


def _ln_bwd(dxh: Tensor, z: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    """dz for x_hat = (z - mean) * rstd given dx_hat (also the closed-form LN gradient operator itself: it is
    symmetric); ATen's fused LayerNorm backward, one op.  Its CPU kernel reads ``mean`` and ``rstd`` as dense
    arrays whatever their strides (torch 2.14): a strided slice of them gives wrong values, hence ``contiguous``
    (free when they already are; pass chunk-major copies in loops)."""
    return torch.ops.aten.native_layer_norm_backward(dxh, z, [z.shape[-1]], mean.detach().contiguous(),
                                                     rstd.detach().contiguous(), None, None, [True, False, False])[0]


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


def _seq_inputs(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, ndir: int, cd: torch.dtype, ln_residual: bool
                ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, the inner targets (v - k with the LayerNorm residual, else v) and lr in scan order (:func:`_seq`), in
    the compute dtype; a shared q/k (Vision-TTT) is copied once."""
    qs, lrs = _seq(q.to(cd), ndir, True), _seq(lr.to(cd), ndir, False)
    ks = qs if k is q else _seq(k.to(cd), ndir, True)
    vs = _seq(v.to(cd), ndir, False)
    return qs, ks, (vs.sub_(ks) if ln_residual else vs), lrs


def _state0(w0: Tensor, b0: Tensor, ndir: int, bsz: int, cd: torch.dtype) -> Tuple[Tensor, Tensor]:
    h, d = w0.shape[2], w0.shape[3]
    w = torch.cat([w0[min(i, w0.shape[0] - 1)].expand(bsz, h, d, d) for i in range(ndir)], 0)
    b = torch.cat([b0[min(i, b0.shape[0] - 1)].expand(bsz, h, 1, d) for i in range(ndir)], 0)
    return w.to(cd), b.to(cd)


#: the forward saves at most this many states (one per segment of mini-batches); the backward recomputes a segment
CKPT_SEGMENTS = 32
#: mini-batches per segment at least (the forward forms a segment's outputs in one batched product)
CKPT_MIN_SEGMENT = 4


def ckpt_every(n_mb: int) -> int:
    """Mini-batches per saved state: max(4, ceil(n_mb / 32)).  Integer ops only, so a symbolic ``n_mb`` (torch.compile
    with dynamic shapes) gives the custom op's fake kernel the exact size of the saved states at every size (a sqrt
    rule was fixed to the traced size).  A state is (d + 1) x d per head: the saved ones cost little memory."""
    return torch.sym_max(CKPT_MIN_SEGMENT, -(-n_mb // CKPT_SEGMENTS))


def _chunks(n: int, mb: int) -> List[Tuple[int, int]]:
    return [(s, min(s + mb, n)) for s in range(0, n, mb)]


def _grad_consts(ts: Tensor, lnw: Tensor, lnb: Tensor, ln_residual: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """What the inner gradient needs of the targets, for all tokens at once: ``(ln_b - t) * ln_w`` and ``ln_w^2``
    (the LayerNorm loss), or the targets themselves."""
    return ((lnb - ts) * lnw, lnw * lnw) if ln_residual else (ts, None)


def _inner_grad(z: Tensor, c: Tensor, lnw2: Optional[Tensor], eps: float) -> Tensor:
    """The per-mini-batch inner gradient (:func:`_ln_grad`: three ops) from :func:`_grad_consts`."""
    return z - c if lnw2 is None else _ln_grad(z, c, lnw2, eps)


def scan_fwd(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ln_w: Tensor,
             ln_b: Tensor, ndir: int, mini_batch: int, ln_residual: bool, eps: float,
             save_states: bool) -> Tuple[Tensor, Tensor]:
    """Forward of the general contract (module docstring); states is empty unless ``save_states``."""
    with _no_autocast(q.device):
        return _scan_fwd(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states)


def _folded(ks: Tensor, lrs: Tensor, tau: Tensor, mini_batch: int) -> Tuple[Tensor, Tensor]:
    """The state-independent factors of every state update, for all tokens at once: ``ka = [k, 1]`` (the bias
    folded into the state as its last row: S = [W; b], z = ka S) and ``e_j ka_j`` (e_j = tau_{c-1} lr_j, c the
    length of token j's mini-batch), both (S, H, N, d + 1), so one mini-batch's update is ``S -= kel^T G``."""
    n = ks.shape[2]
    ka = torch.cat([ks, torch.ones_like(ks[..., :1])], -1)
    el = lrs * tau[mini_batch - 1]
    full = n // mini_batch * mini_batch
    if full < n:  # a shorter last mini-batch steps with its own last tau
        el[..., full:] = lrs[..., full:] * tau[n - full - 1]
    return ka, ka * el[..., None]


def _recurrence(s: Tensor, ka: Tensor, kel: Tensor, gc: Tensor, lnw2: Optional[Tensor], eps: float,
                bounds: Sequence[Tuple[int, int]], off: int = 0) -> Tuple[List[Tensor], List[Tensor], Tensor]:
    """The part of the scan that must run mini-batch by mini-batch (the inner gradient goes through a LayerNorm of
    the state's own prediction): per mini-batch (s, e) of ``bounds`` one ``bmm`` (z = ka S), the inner gradient
    (three ops) and one ``baddbmm`` (S -= kel^T G); ``gc`` holds the tokens from ``off``.  Returns the incoming
    states (S, H, d + 1, d), the inner gradients and the outgoing state."""
    sq, h, d1, d = s.shape
    flat = s.reshape(sq * h, d1, d)
    states, grads = [], []
    for st, e in bounds:
        states.append(flat.view(sq, h, d1, d))
        z = torch.bmm(ka[:, :, st:e].reshape(sq * h, e - st, d1), flat).view(sq, h, e - st, d)
        g = _inner_grad(z, gc[:, :, st - off:e - off], lnw2, eps)
        grads.append(g)
        flat = torch.baddbmm(flat, kel[:, :, st:e].reshape(sq * h, e - st, d1).transpose(1, 2),
                             g.reshape(sq * h, e - st, d), alpha=-1.0)
    return states, grads, flat.view(sq, h, d1, d)


def _scan_fwd(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ln_w: Tensor,
              ln_b: Tensor, ndir: int, mini_batch: int, ln_residual: bool, eps: float,
              save_states: bool) -> Tuple[Tensor, Tensor]:
    _, bsz, h, n, d = q.shape
    cd = _cd(q.dtype)
    qs, ks, ts, lrs = _seq_inputs(q, k, v, lr, ndir, cd, ln_residual)
    tau = tau.to(cd)
    lnw, lnb = ln_w.to(cd).view(1, h, 1, d), ln_b.to(cd).view(1, h, 1, d)
    gc, lnw2 = _grad_consts(ts, lnw, lnb, ln_residual)
    w, b = _state0(w0, b0, ndir, bsz, cd)
    state = torch.cat([w, b], 2)
    ka, kel = _folded(ks, lrs, tau, mini_batch)
    qa = ka if qs is ks else torch.cat([qs, torch.ones_like(qs[..., :1])], -1)
    outs, states = [], []
    n_mb = -(-n // mini_batch)
    ck = ckpt_every(n_mb)
    bounds = _chunks(n, mini_batch)
    for lo in range(0, n_mb, ck):
        hi = min(n_mb, lo + ck)
        if save_states:
            states.append(state)
        # only the recurrence runs mini-batch by mini-batch; a segment's outputs are formed batched afterwards
        ss, gs, state = _recurrence(state, ka, kel, gc, lnw2, eps, bounds[lo:hi])
        full = min(hi, n // mini_batch)
        for g0, g1 in ((lo, full), (max(lo, full), hi)):  # full mini-batches, then a shorter last one
            if g1 <= g0:
                continue
            s0, s1, nc = g0 * mini_batch, min(g1 * mini_batch, n), g1 - g0
            c = (s1 - s0) // nc
            qc = qs[:, :, s0:s1].reshape(-1, h, nc, c, d)
            kc = ks[:, :, s0:s1].reshape(-1, h, nc, c, d)
            lc = lrs[:, :, s0:s1].reshape(-1, h, nc, 1, c)
            sg, gg = [torch.stack(x[g0 - lo:g1 - lo], 2) for x in (ss, gs)]
            eta = torch.tril(tau[:c, None] * lc)
            zb = qa[:, :, s0:s1].reshape(-1, h, nc, c, d + 1) @ sg - (eta * (qc @ kc.transpose(-1, -2) + 1.0)) @ gg
            if ln_residual:
                zb = torch.addcmul(qc + lnb[:, :, None], _ln(zb, eps)[0], lnw[:, :, None])
            outs.append(zb.reshape(-1, h, s1 - s0, d))
    out = sum(_unseq(torch.cat(outs, 2), ndir)).to(q.dtype)
    st = torch.stack(states, 2) if save_states else q.new_empty(0, dtype=cd)
    return out, st


def _per_input(dx: Tensor, x: Tensor, ndir: int) -> Tensor:
    """Scan-order gradient -> the shape and dtype of ``x`` (R, B, H, N, d): summed over the directions if R = 1."""
    dxs = torch.stack(_unseq(dx, ndir))
    return (dxs.sum(0, keepdim=True) if x.shape[0] == 1 else dxs).to(x.dtype)


def _reduce_w(dw: Tensor, like: Tensor, ndir: int) -> Tensor:
    """(ndir B, H, ...) per-sequence gradient -> the shape of w0 / b0 (Rw, Bw, H, ...)."""
    dw = dw.reshape(ndir, -1, *dw.shape[1:])
    if like.shape[0] == 1:
        dw = dw.sum(0, keepdim=True)
    if like.shape[1] == 1:
        dw = dw.sum(1, keepdim=True)
    return dw


def _group_bwd(g0: int, g1: int, n: int, mb: int, sg: Tensor, ds: Tensor, qa: Tensor, ka: Tensor, qs: Tensor,
               ks: Tensor, ts: Tensor, lrs: Tensor, dos: Tensor, tau: Tensor, lnw: Tensor, lnb: Tensor,
               ln_residual: bool, eps: float, grads: Tuple[Tensor, ...]) -> Tensor:
    """Backward of mini-batches g0..g1-1 (all of one size c) from their incoming states sg = [W; b]
    (S, H, nc, d + 1, d); ``ds`` = [dW; db] of the outgoing state of mini-batch g1 - 1; qa, ka: [q, 1], [k, 1].

    Everything outside the (dW, db) recursion is batched over the group's mini-batches; only the recursion runs
    one mini-batch at a time, latest first.  Writes into / accumulates on ``grads = (dq, dk, dv, dlr, dtau, dlnw,
    dlnb)``; returns [dW; db] of the incoming state of mini-batch g0.
    """
    dq, dk, dv, dlr, dtau, dlnw, dlnb = grads
    sq, h, _, d = qs.shape
    s0, s1 = g0 * mb, min(g1 * mb, n)
    nc = g1 - g0
    c = (s1 - s0) // nc

    def chunked(x: Tensor) -> Tensor:
        return x[:, :, s0:s1].reshape(sq, h, nc, c, *x.shape[3:])
    kc, qc, tc, doc, lc = chunked(ks), chunked(qs), chunked(ts), chunked(dos), chunked(lrs)
    kac, qac = chunked(ka), chunked(qa)
    w = sg[..., :d, :]
    lnw5, lnb5 = lnw[:, :, None], lnb[:, :, None]
    tu = tau[:c]
    # recompute the group's forward
    z = kac @ sg
    if ln_residual:
        xh, mu, rs = _ln(z, eps)
        y = lnw5 * xh + lnb5 - tc
        gx = y * lnw5
        g = _ln_bwd(gx, z, mu, rs)
        mgx = (gx * xh).mean(-1, keepdim=True)
        mu_l, rs_l = mu.movedim(2, 0).contiguous(), rs.movedim(2, 0).contiguous()  # mini-batch i: dense [i]
    else:
        g = z - tc
    eta = torch.tril(tu[:, None] * lc[..., None, :])
    sqk = qc @ kc.transpose(-1, -2) + 1.0
    a = eta * sqk
    el = tu[c - 1] * lc
    # output LayerNorm + residual and the dual-form output
    if ln_residual:
        zb = qac @ sg - a @ g
        xh2, mu2, rs2 = _ln(zb, eps)
        dlnw += (doc * xh2).sum((0, 2, 3))
        dlnb += doc.sum((0, 2, 3))
        dzb = _ln_bwd(doc * lnw5, zb, mu2, rs2)
        dqc = doc + dzb @ w.transpose(-1, -2)
    else:
        dzb = doc
        dqc = dzb @ w.transpose(-1, -2)
    da = torch.tril(-dzb @ g.transpose(-1, -2))
    deta = da * sqk
    dsq = da * eta
    dqc = dqc + dsq @ kc
    dkc = dsq.transpose(-1, -2) @ qc
    dga = -a.transpose(-1, -2) @ dzb
    dsa = qac.transpose(-1, -2) @ dzb  # [q^T dzb; sum dzb]
    # the (dW, db) recursion through the state updates, latest mini-batch first
    dg, dz, de, dw_out = torch.empty_like(g), torch.empty_like(g), torch.empty_like(lc), torch.empty_like(w)
    for i in range(nc - 1, -1, -1):
        gi, kai = g[:, :, i], kac[:, :, i]
        p = kai @ ds  # k dW + db
        dgi = dga[:, :, i] - el[:, :, i, :, None] * p
        de[:, :, i] = -(p * gi).sum(-1)
        dg[:, :, i] = dgi
        dw_out[:, :, i] = ds[..., :d, :]
        if ln_residual:
            zi, mi, ri, xi = z[:, :, i], mu_l[i], rs_l[i], xh[:, :, i]
            dy = _ln_bwd(dgi, zi, mi, ri) * lnw
            dxh = dy * lnw - (mgx[:, :, i] * dgi + gx[:, :, i] * (dgi * xi).mean(-1, keepdim=True)) * ri
            dzi = _ln_bwd(dxh, zi, mi, ri) - (dgi * gi).sum(-1, keepdim=True) * xi * (ri / d)
        else:
            dzi = dgi
        dz[:, :, i] = dzi
        ds = torch.baddbmm((ds + dsa[:, :, i]).reshape(sq * h, d + 1, d), kai.reshape(sq * h, c, d + 1).mT,
                           dzi.reshape(sq * h, c, d)).view(sq, h, d + 1, d)
    dkc = dkc - (el[..., None] * g) @ dw_out.transpose(-1, -2) + dz @ w.transpose(-1, -2)
    if ln_residual:
        dgx = _ln_bwd(dg, z, mu, rs)
        dy = dgx * lnw5
        dlnw += (dgx * y + dy * xh).sum((0, 2, 3))
        dlnb += dy.sum((0, 2, 3))
        dt = -dy
        dkc = dkc + dy
    else:
        dt = -dg
    dlr[:, :, s0:s1] = ((deta * tu[:, None]).sum(-2) + de * tu[c - 1]).reshape(sq, h, s1 - s0)
    dtau[:c] += (deta * lc[..., None, :]).sum((0, 1, 2, 4))
    dtau[c - 1] += (de * lc).sum()
    dq[:, :, s0:s1] = dqc.reshape(sq, h, s1 - s0, d)
    dk[:, :, s0:s1] += dkc.reshape(sq, h, s1 - s0, d)  # dk may be dq (shared q/k): add
    dv[:, :, s0:s1] = dt.reshape(sq, h, s1 - s0, d)
    return ds


def scan_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
             ln_w: Tensor, ln_b: Tensor, states: Tensor, ndir: int, mini_batch: int, ln_residual: bool,
             eps: float, shared_qk: bool = False) -> List[Optional[Tensor]]:
    """Backward of :func:`scan_fwd` from the saved checkpoint states.

    Returns [dq, dk, dv, dlr, dtau, dw0, db0, dln_w, dln_b] in the shapes (and dtypes) of the inputs.
    ``shared_qk`` (``k is q``): one gradient buffer; dq holds dq + dk and dk is None.
    """
    if shared_qk and k is not q:
        raise ValueError("shared_qk needs k to be q itself")
    with _no_autocast(q.device):
        return _scan_bwd(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps,
                         shared_qk)


def _scan_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
              ln_w: Tensor, ln_b: Tensor, states: Tensor, ndir: int, mini_batch: int, ln_residual: bool,
              eps: float, shared_qk: bool) -> List[Optional[Tensor]]:
    _, bsz, h, n, d = q.shape
    cd = _cd(q.dtype)
    qs, ks, ts, lrs = _seq_inputs(q, k, v, lr, ndir, cd, ln_residual)
    dos = _seq(do.to(cd), ndir, False)
    tau_c = tau.to(cd)
    lnw, lnb = ln_w.to(cd).view(1, h, 1, d), ln_b.to(cd).view(1, h, 1, d)
    states = states.to(cd)
    dq, dv, dlr = torch.zeros_like(qs), torch.zeros_like(ts), torch.zeros_like(lrs)
    dk = dq if shared_qk else torch.zeros_like(ks)
    dtau = torch.zeros_like(tau_c)
    dlnw = torch.zeros(h, d, dtype=cd, device=q.device)
    dlnb = torch.zeros_like(dlnw)
    ds = torch.zeros(qs.shape[0], h, d + 1, d, dtype=cd, device=q.device)  # [dW; db] of the outgoing state
    n_mb = -(-n // mini_batch)
    ck = ckpt_every(n_mb)
    full = n // mini_batch  # full mini-batches; a shorter last one (if any) has index `full`
    ka, kel = _folded(ks, lrs, tau_c, mini_batch)
    qa = ka if qs is ks else torch.cat([qs, torch.ones_like(qs[..., :1])], -1)
    bounds = _chunks(n, mini_batch)
    grads = (dq, dk, dv, dlr, dtau, dlnw, dlnb)
    for sg in range(-(-n_mb // ck) - 1, -1, -1):
        lo, hi = sg * ck, min(n_mb, (sg + 1) * ck)
        # recompute the incoming states of the segment's mini-batches from its checkpoint
        off = lo * mini_batch  # the segment's targets only: no second token-wide tensor
        gc, lnw2 = _grad_consts(ts[:, :, off:min(hi * mini_batch, n)], lnw, lnb, ln_residual)
        ss, _, last = _recurrence(states[:, :, sg], ka, kel, gc, lnw2, eps, bounds[lo:hi - 1], off)
        ss.append(last)
        # groups of equal-size mini-batches, latest first: the shorter last one, then the full ones
        groups = []
        if hi > full:
            groups.append((full, hi))
        if min(hi, full) > lo:
            groups.append((lo, min(hi, full)))
        for g0, g1 in groups:
            ds = _group_bwd(g0, g1, n, mini_batch, torch.stack(ss[g0 - lo:g1 - lo], 2), ds, qa, ka, qs, ks, ts,
                            lrs, dos, tau_c, lnw, lnb, ln_residual, eps, grads)
    dqs = _per_input(dq, q, ndir)
    dks = None if shared_qk else _per_input(dk, k, ndir)
    dvs, dlrs = sum(_unseq(dv, ndir)), sum(_unseq(dlr, ndir))
    return [dqs, dks, dvs.to(v.dtype), dlrs.to(lr.dtype), dtau.to(tau.dtype),
            _reduce_w(ds[:, :, :d], w0, ndir).to(w0.dtype), _reduce_w(ds[:, :, d:], b0, ndir).to(b0.dtype),
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


def _bidir_positions(n: int, mini_batch: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """In-chunk positions of every token in the forward scan (``t mod b``) and in the reversed one."""
    t = torch.arange(n, device=device)
    return t % mini_batch, (n - 1 - t) % mini_batch


def _rope_tables(x: Tensor, mini_batch: int, theta: float) -> List[Tuple[Tensor, Tensor]]:
    return [rope_1d_tables(p, x.shape[-1], theta, x.dtype) for p in _bidir_positions(x.shape[-2], mini_batch, x.device)]


class TTTLinearRopeScan(torch.autograd.Function):
    """The bidirectional scan with the in-chunk RoPE inside it.  Autograd keeps the unrotated q, k (views of the
    projection that it keeps anyway) and the backward rotates them again, instead of keeping both directions'
    rotated copies and RoPE's cos/sin tables: 2.5 token-wide tensors fewer per block in training."""

    @staticmethod
    def forward(ctx, q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps, theta, shared_qk):
        save = any(ctx.needs_input_grad[:9])
        qc = q.to(_cd(q.dtype))
        q2, k2 = TTTLinearRopeScan._rotated(qc, k, _rope_tables(qc, mini_batch, theta), shared_qk)
        out, st = scan_fwd(q2, k2, v, lr, tau, w0, b0, ln_w, ln_b, 2, mini_batch, ln_residual, eps, save)
        ctx.save_for_backward(q, k, v, lr, tau, w0, b0, ln_w, ln_b, st)
        ctx.cfg = (mini_batch, ln_residual, eps, theta, shared_qk)
        return out.to(q.dtype)  # the scan ran on fp32 rotated copies: back to the input's dtype

    @staticmethod
    def backward(ctx, do):
        q, k, v, lr, tau, w0, b0, ln_w, ln_b, st = ctx.saved_tensors
        mini_batch, ln_residual, eps, theta, shared_qk = ctx.cfg
        qc = q.to(_cd(q.dtype))
        tables = _rope_tables(qc, mini_batch, theta)  # one build for the re-rotation and the rotation back
        q2, k2 = TTTLinearRopeScan._rotated(qc, k, tables, shared_qk)
        dq2, dk2, *rest = scan_bwd(do.contiguous(), q2, k2, v, lr, tau, w0, b0, ln_w, ln_b, st, 2, mini_batch,
                                   ln_residual, eps, shared_qk)  # shared: dq2 holds both gradients, dk2 is None
        back = lambda g: sum(rope_1d(g[i], c, -s) for i, (c, s) in enumerate(tables)).to(q.dtype)  # noqa: E731
        return (back(dq2), None if dk2 is None else back(dk2), *rest, None, None, None, None, None)

    @staticmethod
    def _rotated(qc: Tensor, k: Tensor, tables: List[Tuple[Tensor, Tensor]], shared_qk: bool) -> Tuple[Tensor, Tensor]:
        """(2, B, H, N, d) rotated q and k in the compute dtype of ``qc`` (q already cast), one per direction,
        original token order."""
        q2 = torch.stack([rope_1d(qc, c, s) for c, s in tables])
        if shared_qk:
            return q2, q2
        kc = k.to(qc.dtype)
        return q2, torch.stack([rope_1d(kc, c, s) for c, s in tables])


def bidir_inputs(q: Tensor, k: Tensor, w0: Tensor, b0: Tensor, mini_batch: int, rope_theta: Optional[float]
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """General-contract inputs of the bidirectional scan, in ORIGINAL token order (no flipped copies).

    With RoPE each direction needs its own rotated q, k (position ``t mod b`` forward, ``(N-1-t) mod b`` for the
    reversed scan), stacked as (2, B, H, N, d); without RoPE q, k get a broadcast leading axis of 1.
    """
    check_bidir_state(w0, b0)
    if rope_theta is not None:
        pf, pb = _bidir_positions(q.shape[2], mini_batch, q.device)
        (cf, sf), (cb, sb) = (rope_1d_tables(p, q.shape[-1], rope_theta, q.dtype) for p in (pf, pb))
        q2 = torch.stack([rope_1d(q, cf, sf), rope_1d(q, cb, sb)])
        # shared q/k: an alias, not q2 itself (torch.compile cannot trace an autograd.Function given one tensor twice)
        k2 = q2.view_as(q2) if k is q else torch.stack([rope_1d(k, cf, sf), rope_1d(k, cb, sb)])
    else:
        q2, k2 = q[None], k[None]
    return q2, k2, w0[:, None], b0[:, None]


def single_inputs(q: Tensor, k: Tensor, w0: Tensor, b0: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """General-contract inputs of the one-direction scan: w0 (B|1, H, d, d) -> (1, B|1, H, d, d)."""
    if w0.shape[0] not in (1, q.shape[0]) or b0.shape[0] != w0.shape[0]:
        raise ValueError(f"w0/b0 need a leading dim of 1 or the batch size {q.shape[0]}, got {tuple(w0.shape)}")
    return q[None], k[None], w0[None], b0[None]


def ttt_linear_scan(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                    eps: float = 1e-6, return_grad_norm: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Causal recomputing scan (training), same signature as ``naive.ttt_linear_naive`` (no grad-norm map)."""
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch)
    q1, k1, w1, b1 = single_inputs(q, k, w0, b0)
    return TTTLinearScan.apply(q1, k1, v, lr, tau, w1, b1, ln_w, ln_b, 1, mini_batch, ln_residual, eps), None


def ttt_linear_bidir_scan(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                          rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False
                          ) -> Tuple[Tensor, Optional[Tensor]]:
    """Bidirectional recomputing scan (training, both directions in one batched pass), same signature as
    ``naive.ttt_linear_bidir_naive`` (no grad-norm map)."""
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch)
    check_bidir_state(w0, b0)
    if rope_theta is not None:
        return TTTLinearRopeScan.apply(q, k, v, lr, tau, w0[:, None], b0[:, None], ln_w, ln_b, mini_batch,
                                       ln_residual, eps, float(rope_theta), k is q), None
    q2, k2, w2, b2 = bidir_inputs(q, k, w0, b0, mini_batch, rope_theta)
    return TTTLinearScan.apply(q2, k2, v, lr, tau, w2, b2, ln_w, ln_b, 2, mini_batch, ln_residual, eps), None


def torch_algorithm(bidir: bool, inputs: Sequence[Tensor], return_grad_norm: bool = False) -> Callable:
    """The ``torch`` backend's algorithm (``ttt_linear.choose`` asks here; the signature of the references): export
    -> ``export.py``; the grad-norm map, or no gradient needed for ``inputs`` -> ``chunked.py`` (autocast off: the
    state stays fp32); else the recomputing scan of this file."""
    if exporting() and not return_grad_norm:
        return ttt_linear_bidir_export if bidir else ttt_linear_export
    if return_grad_norm or not needs_grad(*inputs):
        return _INFERENCE[bidir]
    return ttt_linear_bidir_scan if bidir else ttt_linear_scan


def _fp32_state(fn: Callable) -> Callable:
    @wraps(fn)
    def run(q, *args):
        with _no_autocast(q.device):  # autocast would run the per-mini-batch GEMMs in half precision
            return fn(q, *args)
    return run


_INFERENCE = {False: _fp32_state(ttt_linear_chunked), True: _fp32_state(ttt_linear_bidir_chunked)}


def ttt_linear_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                     eps: float = 1e-6, return_grad_norm: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Causal scan on the ``torch`` backend (:func:`torch_algorithm`), same signature as ``naive.ttt_linear_naive``."""
    inputs = (q, k, v, lr, tau, w0, b0, ln_w, ln_b)
    return torch_algorithm(False, inputs, return_grad_norm)(*inputs, mini_batch, ln_residual, eps, return_grad_norm)


def ttt_linear_bidir_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                           rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False
                           ) -> Tuple[Tensor, Optional[Tensor]]:
    """Bidirectional scan on the ``torch`` backend (:func:`torch_algorithm`), same signature as
    ``naive.ttt_linear_bidir_naive``."""
    inputs = (q, k, v, lr, tau, w0, b0, ln_w, ln_b)
    return torch_algorithm(True, inputs, return_grad_norm)(*inputs, mini_batch, ln_residual, rope_theta, eps,
                                                           return_grad_norm)
