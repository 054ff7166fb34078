"""Lean PyTorch path of the T5 and DiT5 inner steps: an analytic backward that recomputes instead of storing.

Both inner models share one form, per (batch, head), with A the first layer and O the output layer:
    T5   (gated):  h = silu(k W1) * (k W2),  f = h W3,   e = dL/df = -(scale / N) v        (dot-product loss)
    DiT5 (mlp):    h = silu(k W1),           f = h W2,   e = dL/df = (scale / N) (f - v)   (regression loss)
    dh = e O^T;  G_O = h^T e;  G1 = k^T (dh * [z2] * silu'(z1));  G2 = k^T (dh * silu(z1))  (T5 only)
    W' = W - G  (one step, lr 1),  out = silu(q W1') [* (q W2')] O'.
The ``autograd.Function`` stores only q, k, v, the initial weights and the updated weights W' ((B, heads, d, d)
each); every N x d intermediate (z, silu, h, e, ...) is recomputed in the backward.

Backward, with dO given and D = -dW' the cotangent of G (the updated-weight gradient dW' comes from the apply):
    apply:  y = q W1' (and y2 = q W2'),  dO' = hq^T dO,  dhq = dO O'^T,  dy = chain rule of silu (and the gate)
    update: dk, dv and dW = dW' + (the gradient through G) by reverse-mode through the formulas above, using
            silu''(z) = s (1 - s) (2 + z (1 - 2 s)).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..utils import compute_dtype, make_function, no_autocast
from ..utils import reduce_to as _reduce_to

__all__ = ["compute_dtype", "inner_fwd", "inner_bwd", "t5_fwd", "t5_bwd", "dit5_fwd", "dit5_bwd",
           "t5_swiglu_ttt_torch", "mlp_ttt_torch", "make_function", "no_autocast"]


def _silu_parts(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(z)
    return z * s, s * (1.0 + z * (1.0 - s)), s  # silu, silu', sigmoid


def _tr(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1)


def inner_update(k: torch.Tensor, v: torch.Tensor, ws: Sequence[torch.Tensor], scale: float,
                 gated: bool) -> List[torch.Tensor]:
    """Inner gradients G, one (B, heads, d, d) per weight (T5: G1, G2, G3; DiT5: G1, G2)."""
    c = scale / k.shape[-2]
    wo = ws[-1]
    z1 = k @ ws[0]
    a, da, _ = _silu_parts(z1)
    if gated:
        z2 = k @ ws[1]
        h = a * z2
        e = v * -c
        dh = e @ _tr(wo)
        return [_tr(k) @ (dh * z2 * da), _tr(k) @ (dh * a), _tr(h) @ e]
    e = (a @ wo - v) * c
    dh = e @ _tr(wo)
    return [_tr(k) @ (dh * da), _tr(a) @ e]


def inner_apply(q: torch.Tensor, ws: Sequence[torch.Tensor], gated: bool) -> torch.Tensor:
    h = F.silu(q @ ws[0])
    if gated:
        h = h * (q @ ws[1])
    return h @ ws[-1]


def inner_fwd(q, k, v, ws: Sequence[torch.Tensor], scale: float, gated: bool):
    """Returns (out in q's dtype, [W'] in the compute dtype, batch B)."""
    dt = compute_dtype(q.dtype)
    qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
    wc = [w.to(dt) for w in ws]
    gs = inner_update(kc, vc, wc, scale, gated)
    wn = [w - g for w, g in zip(wc, gs)]
    out = inner_apply(qc, wn, gated)
    return (out if out.dtype == q.dtype else out.to(q.dtype)), wn


def inner_bwd(do, q, k, v, ws: Sequence[torch.Tensor], wn: Sequence[torch.Tensor], scale: float, gated: bool):
    """Gradients [dq, dk, dv, dW...] from the saved inputs and updated weights W'."""
    in_dt, w_dt = q.dtype, ws[0].dtype
    dt = compute_dtype(q.dtype)
    do, q, k, v = do.to(dt), q.to(dt), k.to(dt), v.to(dt)
    ws = [w.to(dt) for w in ws]
    wn = [w.to(dt) for w in wn]
    c = scale / k.shape[-2]
    # ---- apply: out = silu(q W1') [* q W2'] O'
    y1 = q @ wn[0]
    a, da, _ = _silu_parts(y1)
    dhq = do @ _tr(wn[-1])
    if gated:
        y2 = q @ wn[1]
        dwn_o = _tr(a * y2) @ do
        dy1, dy2 = dhq * y2 * da, dhq * a
        dq = dy1 @ _tr(wn[0]) + dy2 @ _tr(wn[1])
        dwn = [_tr(q) @ dy1, _tr(q) @ dy2, dwn_o]
        del y2, dy2
    else:
        dwn_o = _tr(a) @ do
        dy1 = dhq * da
        dq = dy1 @ _tr(wn[0])
        dwn = [_tr(q) @ dy1, dwn_o]
    del y1, a, da, dhq, dy1
    dg = [-t for t in dwn]  # cotangent of G (W' = W - G)
    # ---- update: recompute z, silu, h, e from k, v, W (temporaries freed as soon as they are used)
    wo = ws[-1]
    z1 = k @ ws[0]
    s1, ds1, sg = _silu_parts(z1)
    d2s1 = sg * (1.0 - sg) * (2.0 + z1 * (1.0 - 2.0 * sg))
    del z1, sg
    if gated:
        z2 = k @ ws[1]
        h = s1 * z2
        e = v * -c
    else:
        h = s1
        e = (s1 @ wo - v) * c
    dh = e @ _tr(wo)
    dpa = k @ dg[0]                  # cotangent of P1 in G1 = k^T P1
    dha = e @ _tr(dg[-1])            # cotangent of h from G_O = h^T e
    de = h @ dg[-1]                  # cotangent of e from G_O
    if gated:
        del h
        dpb = k @ dg[1]
        dk = (dh * z2 * ds1) @ _tr(dg[0]) + (dh * s1) @ _tr(dg[1])
        ddh = dpa * z2 * ds1 + dpb * s1
        dz2 = dpa * dh * ds1 + dha * s1
        dz1 = dpa * dh * z2 * d2s1 + dpb * dh * ds1 + dha * z2 * ds1
        del dpa, dpb, dha, dh, s1, ds1, d2s1, z2
        de = de + ddh @ wo
        dv = de * -c
        del de
        dk = dk + dz1 @ _tr(ws[0]) + dz2 @ _tr(ws[1])
        dw = [_tr(k) @ dz1, _tr(k) @ dz2, _tr(ddh) @ e]
    else:
        dk = (dh * ds1) @ _tr(dg[0])
        ddh = dpa * ds1
        de = de + ddh @ wo
        df = de * c
        del de
        dv = -df
        dz1 = dpa * dh * d2s1 + (dha + df @ _tr(wo)) * ds1
        del dpa, dh, d2s1, dha, ds1
        dk = dk + dz1 @ _tr(ws[0])
        dw = [_tr(k) @ dz1, _tr(ddh) @ e + _tr(h) @ df]
    dws = [_reduce_to(a_ + b_, w).to(w_dt) for a_, b_, w in zip(dwn, dw, ws)]
    return [dq.to(in_dt), dk.to(in_dt), dv.to(in_dt)] + dws


def model_entry_points(fwd, bwd):
    """(t5_fwd, t5_bwd, dit5_fwd, dit5_bwd): the T5 (3 weights, gated) and DiT5 (2 weights) forms of an
    ``inner_fwd`` / ``inner_bwd`` pair with flat tensor arguments, as the custom ops and ``make_function`` take them."""

    def t5_fwd(q, k, v, w1, w2, w3, scale: float):
        out, wn = fwd(q, k, v, (w1, w2, w3), scale, True)
        return out, wn[0], wn[1], wn[2]

    def t5_bwd(do, q, k, v, w1, w2, w3, w1n, w2n, w3n, scale: float):
        return bwd(do, q, k, v, (w1, w2, w3), (w1n, w2n, w3n), scale, True)

    def dit5_fwd(q, k, v, w1, w2, scale: float):
        out, wn = fwd(q, k, v, (w1, w2), scale, False)
        return out, wn[0], wn[1]

    def dit5_bwd(do, q, k, v, w1, w2, w1n, w2n, scale: float):
        return bwd(do, q, k, v, (w1, w2), (w1n, w2n), scale, False)

    return t5_fwd, t5_bwd, dit5_fwd, dit5_bwd


t5_fwd, t5_bwd, dit5_fwd, dit5_bwd = model_entry_points(inner_fwd, inner_bwd)
T5TTT = make_function("T5TTT", t5_fwd, t5_bwd, 3)
DiT5TTT = make_function("DiT5TTT", dit5_fwd, dit5_bwd, 2)


def _check(q, k, v, ws: Sequence[torch.Tensor], op: str) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"{op}: q, k, v must share a (B, heads, N, d) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, _, d = q.shape
    for i, w in enumerate(ws):
        if w.dim() != 4 or tuple(w.shape[1:]) != (h, d, d) or w.shape[0] not in (1, b):
            raise ValueError(f"{op}: w{i + 1} must be (1 or B, heads, d, d) = (1 or {b}, {h}, {d}, {d}), "
                             f"got {tuple(w.shape)}")


def _lerp(out: torch.Tensor, mix: Optional[torch.Tensor], mix_weight: float) -> torch.Tensor:
    """(1 - a) out + a mix as one ``torch.lerp`` (autograd differentiates it); out without a mix."""
    return out if mix is None else torch.lerp(mix, out, 1.0 - mix_weight)


def t5_swiglu_ttt_torch(q, k, v, w1, w2, w3, scale: float, mix: Optional[torch.Tensor] = None,
                        mix_weight: float = 0.0) -> torch.Tensor:
    """T5 inner step + apply (same signature as ``t5_swiglu_ttt_reference``), recomputing backward."""
    _check(q, k, v, (w1, w2, w3), "t5_swiglu_ttt")
    return _lerp(T5TTT.apply(q, k, v, w1, w2, w3, float(scale)), mix, mix_weight)


def mlp_ttt_torch(q, k, v, w1, w2, scale: float, mix: Optional[torch.Tensor] = None,
                  mix_weight: float = 0.0) -> torch.Tensor:
    """DiT5 inner step + apply (same signature as ``mlp_ttt_reference``), recomputing backward."""
    _check(q, k, v, (w1, w2), "dit5_mlp_ttt")
    return _lerp(DiT5TTT.apply(q, k, v, w1, w2, float(scale)), mix, mix_weight)


# ------------------------------------------------------------------ the last-layer step (T5 / DiT5 V1 and V3)
def last_layer_ttt_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: float,
                         loss: str = "dot", steps: int = 1) -> torch.Tensor:
    """Closed form of ``naive.last_layer_ttt_reference``: GEMMs over the tokens, nothing of size N x d x d.

    dot (T5): the gradient does not depend on W, so k steps are one step of k times the update:
        out = q W + (k scale / N) q (k^T v)                                   -- two GEMMs per head
    mse (DiT5): with A = (scale / N) k^T k and R = (scale / N) k^T v (both d x d, one pass over the tokens),
        W <- W - (A W - R) per step, out = q W.
    Autograd stores only q, k, v and the d x d matrices.
    """
    if loss not in ("dot", "mse"):
        raise ValueError("loss must be 'dot' or 'mse', got " + loss)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not torch.jit.is_scripting():  # TorchScript cannot script the autocast helper (and never autocasts)
        with no_autocast(q.device):  # float32 GEMMs under autocast too (the inner step picks its precision)
            return _last_layer_step(q, k, v, w, scale, loss, steps)
    return _last_layer_step(q, k, v, w, scale, loss, steps)


def _last_layer_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: float,
                     loss: str, steps: int) -> torch.Tensor:
    out_dtype = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v, w = q.to(dt), k.to(dt), v.to(dt), w.to(dt)
    c = scale / k.shape[-2]
    kt = _tr(k)
    if loss == "dot":
        w = w + (kt @ v) * (steps * c)
    else:
        a, r = (kt @ k) * c, (kt @ v) * c
        for _ in range(steps):
            w = w - (a @ w - r)
    return (q @ w).to(out_dtype)
