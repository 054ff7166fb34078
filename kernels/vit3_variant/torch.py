"""Lean PyTorch path of the ViT3 inner-loop variants: analytic backward that recomputes instead of storing.

Every branch step is ``W' = W - lr N(G)`` with the raw inner gradient G saved for the backward (d x d per head):
  last  (Variant 1): z = k W2, a = silu(z),  G = c k^T (v a),  out = (q W1') silu(q W2)
        no z1 = k W1, no gate gradient, no second step (2 of the baseline's 3 GEMM pairs per token tile).
  linear (Variant 3 / 6): G = c k^T v,  out = q W1': two GEMMs per head, nothing of size N x d x d.
  all   (the baseline SwiGLU): ``kernels/vit3_ttt`` with ``scale * lr`` (lr = +-1: N(-G) = -N(G) exactly).
Backward of ``W' = W - lr N(G)``: dW = dW', dG = normbwd(G, -lr dW').
``lr`` = sign * steps: k steps of a loss linear in W (last, linear, the conv branch) add k N(G) (G does not depend
on W); -1 is gradient ascent.  k > 1 steps of the full SwiGLU run the reference (``naive.py``) under autograd.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..backend import exporting
from ..utils import autocast_state, compute_dtype, no_autocast, reduce_to
from ..rope import rope_2d
from ..vit3_ttt.torch import _dwconv, _foldable, _packed_maps, _taps, normalize_columns, normalize_columns_bwd, \
    swiglu_bwd, swiglu_fwd
from .common import variant_qkv_split
from .naive import variant_qkv_naive  # k > 1 full SwiGLU steps: no closed form, the reference's loop (run_variant)

__all__ = ["last_fwd", "last_bwd", "linear_fwd", "linear_bwd", "conv_fwd", "conv_bwd", "all_fwd", "all_bwd",
           "make_variant_function", "variant_qkv_torch", "variant_forward"]


def _step(w: torch.Tensor, g: torch.Tensor, normalize: bool, lr: float, dim=-2) -> torch.Tensor:
    """W - lr N(g), N(g) = g / (||g|| + 1) over ``dim`` (norm, add, addcdiv: three launches; one without N)."""
    if not normalize:
        return torch.add(w, g, alpha=-lr)
    if exporting():  # TorchScript's ONNX exporter has no addcdiv
        return w - lr * normalize_columns(g, dim)
    return torch.addcdiv(w, g, torch.linalg.vector_norm(g, dim=dim, keepdim=True).add_(1.0), value=-lr)


def _dg(g: torch.Tensor, dwn: torch.Tensor, normalize: bool, lr: float) -> torch.Tensor:
    return normalize_columns_bwd(g, -lr * dwn) if normalize else -lr * dwn


def _silu_d(z: torch.Tensor):
    s = torch.sigmoid(z)
    silu = z * s
    return silu, torch.addcmul(s, silu, 1.0 - s)  # silu, silu'


# ------------------------------------------------------------------------------------- Variant 1: last layer
def last_fwd(q, k, v, w1, w2, scale: float, normalize: bool, lr: float):
    """(out, G1): only W1 steps; the gate silu(x W2) keeps W2."""
    out_dt, dt = q.dtype, compute_dtype(q.dtype)
    q, k, v, w1, w2 = _foldable(q.to(dt)), _foldable(k.to(dt)), v.to(dt), w1.to(dt), w2.to(dt)
    g = k.transpose(-2, -1) @ (v * F.silu(k @ w2)) * (-scale / k.shape[-2])
    w1n = _step(w1, g, normalize, lr)
    return ((q @ w1n) * F.silu(q @ w2)).to(out_dt), g


def last_bwd(do, q, k, v, w1, w2, g, scale: float, normalize: bool, lr: float):
    in_dt, w_dt = q.dtype, w1.dtype
    dt = compute_dtype(q.dtype)
    do, q, k, v, g, w1, w2 = do.to(dt), _foldable(q.to(dt)), _foldable(k.to(dt)), v.to(dt), g.to(dt), w1.to(dt), \
        w2.to(dt)
    c = -scale / k.shape[-2]
    w1n = _step(w1, g, normalize, lr)
    # apply: out = y1 silu(y2), y1 = q W1', y2 = q W2
    y1, y2 = q @ w1n, q @ w2
    s2, ds2 = _silu_d(y2)
    dy1 = do * s2
    dy2 = ds2.mul_(y1).mul_(do)
    del y1, y2, s2
    dq = dy1 @ w1n.transpose(-2, -1) + dy2 @ w2.transpose(-2, -1)
    qt = q.transpose(-2, -1)
    dw1 = qt @ dy1
    dw2 = qt @ dy2
    del dy1, dy2
    dg = _dg(g, dw1, normalize, lr)
    # update: G = c k^T (v silu(z)), z = k W2
    z = k @ w2
    a, da_dz = _silu_d(z)
    dgc = dg * c
    dva = k @ dgc                                  # d(v a)
    dk = (v * a) @ dgc.transpose(-2, -1)
    dv = dva * a
    dz = dva.mul_(v).mul_(da_dz)
    dk += dz @ w2.transpose(-2, -1)
    dw2 += k.transpose(-2, -1) @ dz
    return dq.to(in_dt), dk.to(in_dt), dv.to(in_dt), reduce_to(dw1, w1).to(w_dt), reduce_to(dw2, w2).to(w_dt)


# ------------------------------------------------------------------------------ Variants 3 / 6: single linear
def linear_fwd(q, k, v, w1, w2, scale: float, normalize: bool, lr: float):
    """(out, G): S = W1 - lr N(c k^T v), out = q S (``w2`` is unused: None)."""
    out_dt, dt = q.dtype, compute_dtype(q.dtype)
    q, k, v = _foldable(q.to(dt)), _foldable(k.to(dt)), _foldable(v.to(dt))
    g = (k.transpose(-2, -1) @ v).mul_(-scale / k.shape[-2])
    return (q @ _step(w1.to(dt), g, normalize, lr)).to(out_dt), g


def linear_bwd(do, q, k, v, w1, w2, g, scale: float, normalize: bool, lr: float):
    in_dt, w_dt = q.dtype, w1.dtype
    dt = compute_dtype(q.dtype)
    do, q, k, v, g = do.to(dt), _foldable(q.to(dt)), _foldable(k.to(dt)), _foldable(v.to(dt)), g.to(dt)
    c = -scale / k.shape[-2]
    s = _step(w1.to(dt), g, normalize, lr)
    dq = do @ s.transpose(-2, -1)
    dw1 = q.transpose(-2, -1) @ do
    dgc = _dg(g, dw1, normalize, lr) * c
    dk = v @ dgc.transpose(-2, -1)
    dv = k @ dgc
    return dq.to(in_dt), dk.to(in_dt), dv.to(in_dt), reduce_to(dw1, w1).to(w_dt), None


# -------------------------------------------------------------------------------- baseline SwiGLU (all layers)
def all_fwd(q, k, v, w1, w2, scale: float, normalize: bool, lr: float):
    """One step of the full SwiGLU (``lr`` = +-1 only; the sign folds into the scale)."""
    return swiglu_fwd(q, k, v, w1, w2, scale * lr, normalize)


def all_bwd(do, q, k, v, w1, w2, g, scale: float, normalize: bool, lr: float):
    return swiglu_bwd(do, q, k, v, w1, w2, g, scale * lr, normalize)


# ----------------------------------------------------------------------------------------------- conv branch
def conv_fwd(q, k, v, w3, scale: float, normalize: bool, lr: float):
    out_dt, dt = q.dtype, compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    b, d, h, w = k.shape
    g = _taps(k, v) * (-scale / (h * w))
    w3n = _step(w3.to(dt).reshape(1, d, 3, 3), g, normalize, lr, (-2, -1))
    return _dwconv(q, w3n.expand(b, d, 3, 3)).to(out_dt), g


def conv_bwd(do, q, k, v, w3, g, scale: float, normalize: bool, lr: float):
    in_dt, w_dt = q.dtype, w3.dtype
    dt = compute_dtype(q.dtype)
    do, q, k, v, g = do.to(dt), q.to(dt), k.to(dt), v.to(dt), g.to(dt)
    b, d, h, w = k.shape
    c = -scale / (h * w)
    w3n = _step(w3.to(dt).reshape(1, d, 3, 3), g, normalize, lr, (-2, -1))
    dq = _dwconv(do, w3n.expand(b, d, 3, 3), transposed=True)
    dwn = _taps(q, do)
    dgc = (normalize_columns_bwd(g, -lr * dwn, (-2, -1)) if normalize else dwn * -lr) * c
    dk = _dwconv(v, dgc, transposed=True)
    dv = _dwconv(k, dgc)
    return dq.to(in_dt), dk.to(in_dt), dv.to(in_dt), dwn.sum(0).reshape(d, 1, 3, 3).to(w_dt)


BRANCHES = {"all": (all_fwd, all_bwd), "last": (last_fwd, last_bwd), "linear": (linear_fwd, linear_bwd)}


# ------------------------------------------------------------------------ projection + both branches (Function)
def _merge(heads, maps, dtype=None):
    """(B, N, len(heads) C + len(maps) d): SwiGLU-branch tensors (B, heads, N, d) heads-merged, then conv-branch maps
    (B, d, H, W) channels last, in one cat of strided views (the conv head is one more head of width d)."""
    parts = [t.transpose(1, 2) for t in heads] + [t.flatten(2).transpose(1, 2).unsqueeze(2) for t in maps]
    return torch.cat([p if dtype is None else p.to(dtype) for p in parts], dim=2).flatten(2)


def variant_forward(x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize, kind, lr, share_qk,
                    impls):
    """No autograd: (out (B, N, C + d), G_swiglu, G_conv); ``impls`` = (swiglu fwd, swiglu bwd, conv fwd, conv bwd)."""
    (q1, k1, v1), (q2, k2, v2) = variant_qkv_split(x, weight, bias, feat_size, heads, cos, sin, share_qk)
    q2, k2, v2 = _packed_maps(q2, k2, v2)
    b, n, c = x.shape
    with no_autocast(x.device):
        x1, g1 = impls[0](q1, k1, v1, w1, w2, scale, normalize, lr)
        x2, g3 = impls[2](q2, k2, v2, w3, scale, normalize, lr)
        out = _merge([x1], [x2.to(x1.dtype)])
    return out, g1, g3


def make_variant_function(name: str, branches, conv):
    """autograd.Function over the variant mixer core for a branch table ``{kind: (fwd, bwd)}`` and ``conv`` =
    (fwd, bwd); stores only x, the weights and the raw inner gradients, recomputes the projection in the backward."""

    def impls(kind):
        return branches[kind] + conv

    def forward(ctx, x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize, kind, lr, share_qk):
        out, g1, g3 = variant_forward(x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize,
                                      kind, lr, share_qk, impls(kind))
        ctx.save_for_backward(x, weight, bias, w1, w2, w3, g1, g3, cos, sin)
        ctx.args = (feat_size, heads, scale, normalize, kind, lr, share_qk)
        ctx.amp = autocast_state(x.device)
        return out

    def backward(ctx, dout):
        x, weight, bias, w1, w2, w3, g1, g3, cos, sin = ctx.saved_tensors
        feat_size, heads, scale, normalize, kind, lr, share_qk = ctx.args
        b, n, c = x.shape
        h, w = feat_size
        d = c // heads
        f = impls(kind)
        with torch.no_grad(), no_autocast(x.device, *ctx.amp):
            (q1, k1, v1), (q2, k2, v2) = variant_qkv_split(x, weight, bias, feat_size, heads, cos, sin, share_qk)
            q2, k2, v2 = _packed_maps(q2, k2, v2)
        with torch.no_grad(), no_autocast(x.device):
            dx1 = dout[..., :c].reshape(b, n, heads, d).transpose(1, 2)
            dq1, dk1, dv1, dw1, dw2 = f[1](dx1, q1, k1, v1, w1, w2, g1, scale, normalize, lr)
            dx2 = dout[..., c:].transpose(1, 2).reshape(b, d, h, w)
            dq2, dk2, dv2, dw3 = f[3](dx2, q2, k2, v2, w3, g3, scale, normalize, lr)
            del q1, k1, v1, q2, k2, v2
            if share_qk:  # q is k: its gradient joins k's, and there are no query rows
                dqkv = _merge([dq1 + dk1, dv1], [dq2 + dk2, dv2], dout.dtype)
            else:
                dqkv = _merge([dq1, dk1, dv1], [dq2, dk2, dv2], dout.dtype)
            if cos is not None:  # RoPE is a rotation: its transpose turns by -angle
                nr = 1 if share_qk else 2  # the rotated rows: (q,) k
                qk = dqkv[..., :nr * c].unflatten(-1, (nr, c)).transpose(1, 2).reshape(b * nr, h, w, c)
                dqkv[..., :nr * c] = rope_2d(qk, cos, -sin).reshape(b, nr, n, c).transpose(1, 2).flatten(2)
        with torch.no_grad(), no_autocast(x.device, *ctx.amp):
            dx = (dqkv @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
            dweight = (dqkv.reshape(-1, dqkv.shape[-1]).t() @ x.reshape(-1, c)).to(weight.dtype)
            dbias = dqkv.sum((0, 1)).to(bias.dtype) if bias is not None else None
        return (dx, dweight, dbias, dw1, dw2, dw3) + (None,) * 9

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


VariantQKV = make_variant_function("VariantQKV", BRANCHES, (conv_fwd, conv_bwd))


def branch_kind(w2: Optional[torch.Tensor], last_only: bool) -> str:
    return "linear" if w2 is None else ("last" if last_only else "all")


def run_variant(function, infer, x, weight, bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos, sin,
                last_only, lr, share_qk, steps):
    """Shared entry of the torch and Triton paths: k > 1 steps of the full SwiGLU go to the reference; without
    autograd ``infer(*args)`` (``function``'s arguments) gives the output, else ``function.apply``."""
    kind = branch_kind(w2, last_only)
    if kind == "all" and abs(lr) != 1.0:
        raise ValueError(f"the full SwiGLU step takes lr = +1 (descent) or -1 (ascent), got {lr}")
    if steps > 1 and kind == "all":  # the gate moves between steps: no closed form, run the loop
        return variant_qkv_naive(x, weight, bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos, sin,
                                 last_only, lr, share_qk, steps)
    lr = float(lr) * (steps if kind != "all" else 1)   # loss linear in the stepped weights: k steps = k N(G)
    # the map size stays symbolic under torch.export (int() would bake the traced size into an ONNX graph)
    fs = tuple(s if isinstance(s, (int, torch.SymInt)) or exporting() else int(s) for s in feat_size)
    args = (x, weight, bias, w1, w2, w3, cos, sin, fs, int(heads), float(scale),
            bool(normalize_grad), kind, lr, bool(share_qk))
    if exporting() or not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in args[:8]):
        return infer(*args)
    return function.apply(*args)


def variant_qkv_torch(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
                      cos=None, sin=None, last_only: bool = False, lr: float = 1.0, share_qk: bool = False,
                      steps: int = 1) -> torch.Tensor:
    """Variant mixer core, PyTorch path (same signature as ``naive.variant_qkv_naive``)."""
    return run_variant(VariantQKV, _infer, x, weight, bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos,
                       sin, last_only, lr, share_qk, steps)


def _infer(*args):
    return variant_forward(*args, BRANCHES[args[12]] + (conv_fwd, conv_bwd))[0]
