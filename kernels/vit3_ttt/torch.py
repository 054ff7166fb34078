"""Lean PyTorch path of the ViT3 inner step: analytic backward that recomputes instead of storing.

Same math as ``naive.py`` (see there and spec §1), but wrapped in ``torch.autograd.Function`` so that autograd
stores only the inputs (q, k, v, the initial weights) and the d x 2d pre-normalisation gradient per (batch, head).
Every N x d intermediate (k W, sigmoid, the SwiGLU derivative, q W', ...) is recomputed in the backward.

The pieces (``*_fwd`` / ``*_bwd``) are plain functions so the Triton path and the torch.library ops reuse them.

SwiGLU branch, per (batch, head), c = -scale / N, W = [W1 | W2] (d x 2d):
    z = k W,  A = [v * silu(z2), v * z1 * silu'(z2)],  G = c k^T A,  G^ = G / (||G[:, j]|| + 1),  W' = W - G^
    out = (q W1') * silu(q W2')
Backward (dO given):
    dy = [dO * silu(y2), dO * y1 * silu'(y2)],  dq = dy W'^T,  dW' = q^T dy
    dG = normbwd(G, -dW'),  dA = c k dG,  dk = c A dG^T + dz W^T,  dW = dW' + k^T dz
    dv = dA1 silu(z2) + dA2 z1 silu'(z2),  dz1 = dA2 v silu'(z2),  dz2 = dA1 v silu'(z2) + dA2 v z1 silu''(z2)
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..backend import exporting
from ..utils import autocast_state as _autocast_state
from ..utils import compute_dtype, make_function
from ..utils import no_autocast as _autocast
from ..utils import reduce_to as _reduce_to
from .common import qkv_split, rope_2d

__all__ = [
    "swiglu_ttt_torch", "dwconv_ttt_torch", "swiglu_fwd", "swiglu_bwd", "dwconv_fwd", "dwconv_bwd",
    "normalize_columns", "normalize_columns_bwd", "make_function", "make_qkv_function", "qkv_ttt_torch",
    "qkv_forward", "swiglu_apply",
]


def normalize_columns(g: torch.Tensor, dim=-2) -> torch.Tensor:
    """g / (||g|| + 1), norm over ``dim`` (rows of a d x d gradient, or the 3x3 taps)."""
    return g / (torch.linalg.vector_norm(g, dim=dim, keepdim=True) + 1.0)


def normalize_columns_bwd(g: torch.Tensor, dghat: torch.Tensor, dim=-2) -> torch.Tensor:
    """Backward of :func:`normalize_columns`: dg = dg^/(n+1) - g <dg^, g> / (n (n+1)^2), with 0 where n = 0."""
    n = torch.linalg.vector_norm(g, dim=dim, keepdim=True)
    dot = (dghat * g).sum(dim=dim, keepdim=True)
    coef = torch.where(n > 0, dot / (n.clamp_min(torch.finfo(n.dtype).tiny) * (n + 1.0) ** 2), torch.zeros_like(n))
    return dghat / (n + 1.0) - g * coef


def _silu_parts(z: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(z)
    return z * s, s * (1.0 + z * (1.0 - s))  # silu(z), silu'(z)


# ----------------------------------------------------------------------------------------------- SwiGLU branch
def swiglu_update(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """Raw inner gradient G = c k^T [v silu(z2), v z1 silu'(z2)], (B, heads, d, 2d), in k's dtype.

    Not differentiable (called inside autograd.Function / custom-op forwards): the elementwise chain runs in place,
    and the two halves of A meet only as d x d products (no N x 2d concat).
    """
    d = k.shape[-1]
    z = k @ w
    z1, z2 = z[..., :d], z[..., d:]
    s = torch.sigmoid(z2)
    a1 = z2 * s                                   # silu(z2)
    a2 = torch.addcmul(s, a1, 1.0 - s)            # silu'(z2) = s + silu(z2) (1 - s)
    a2.mul_(z1).mul_(v)
    a1.mul_(v)
    kt = k.transpose(-2, -1)
    return torch.cat([kt @ a1, kt @ a2], dim=-1) * (-scale / k.shape[-2])


def swiglu_apply(q: torch.Tensor, wn: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = (q W1') * silu(q W2'), written into ``out`` (any strided (B, heads, N, d) view) when given."""
    d = q.shape[-1]
    y = q @ wn
    if torch.compiler.is_compiling():  # no in-place op on a view (inductor), no strided out= (dynamo)
        res = y[..., :d] * F.silu(y[..., d:])
        return res if out is None else out.copy_(res)
    y2 = F.silu(y[..., d:], inplace=True)
    if out is None:
        return y[..., :d] * y2
    return torch.mul(y[..., :d], y2, out=out)


def swiglu_fwd(q, k, v, w1, w2, scale: float, normalize_grad: bool = True,
               out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out in q's dtype, raw inner gradient G in the compute dtype); ``out=`` receives the result."""
    out_dt = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    w = torch.cat([w1, w2], dim=-1).to(dt)
    g = swiglu_update(k, v, w, scale)
    wn = w - (normalize_columns(g) if normalize_grad else g)
    res = swiglu_apply(q, wn, out)
    return (res if out is not None else res.to(out_dt)), g


def swiglu_bwd(do, q, k, v, w1, w2, g, scale: float, normalize_grad: bool = True):
    """Gradients (dq, dk, dv, dw1, dw2) from the saved inputs and the raw inner gradient ``g``."""
    in_dt, w_dt = q.dtype, w1.dtype
    dt = compute_dtype(q.dtype)
    do, q, k, v, g = do.to(dt), q.to(dt), k.to(dt), v.to(dt), g.to(dt)
    w = torch.cat([w1, w2], dim=-1).to(dt)
    d, n = q.shape[-1], q.shape[-2]
    c = -scale / n
    # apply step: out = y1 * silu(y2), y = q W'  (the two halves stay separate: no N x 2d concats)
    wn = w - (normalize_columns(g) if normalize_grad else g)
    wn1, wn2 = wn[..., :d], wn[..., d:]
    y = q @ wn
    y1, y2 = y[..., :d], y[..., d:]
    s = torch.sigmoid(y2)
    dy1 = y2 * s                                             # silu(y2)
    dy2 = torch.addcmul(s, dy1, 1.0 - s).mul_(y1).mul_(do)   # dO * y1 * silu'(y2)
    dy1.mul_(do)                                             # dO * silu(y2)
    del y, y1, y2, s
    dq = dy1 @ wn1.transpose(-2, -1)
    dq += dy2 @ wn2.transpose(-2, -1)
    qt = q.transpose(-2, -1)
    dwn = torch.cat([qt @ dy1, qt @ dy2], dim=-1)
    del dy1, dy2
    dg = normalize_columns_bwd(g, -dwn) if normalize_grad else -dwn
    dg1, dg2 = dg[..., :d], dg[..., d:]
    # update step: G = c k^T A(z = k W)
    z = k @ w
    z1, z2 = z[..., :d], z[..., d:]
    s = torch.sigmoid(z2)
    silu = z2 * s
    dsilu = torch.addcmul(s, silu, 1.0 - s)
    d2silu = s * (1.0 - s) * (2.0 + z2 * (1.0 - 2.0 * s))
    del s
    vz1 = v * z1
    da1 = (k @ dg1).mul_(c)
    da2 = (k @ dg2).mul_(c)
    dk = (v * silu) @ dg1.transpose(-2, -1)
    dk += (vz1 * dsilu) @ dg2.transpose(-2, -1)
    dk.mul_(c)
    dv = da1 * silu
    dv.addcmul_(da2, z1 * dsilu)
    vd = v * dsilu
    dz1 = da2 * vd
    dz2 = da1 * vd
    dz2.addcmul_(da2 * vz1, d2silu)
    del z, silu, dsilu, d2silu, vz1, vd, da1, da2
    dk += dz1 @ w[..., :d].transpose(-2, -1)
    dk += dz2 @ w[..., d:].transpose(-2, -1)
    kt = k.transpose(-2, -1)
    dw1 = _reduce_to(dwn[..., :d] + kt @ dz1, w1)
    dw2 = _reduce_to(dwn[..., d:] + kt @ dz2, w2)
    return dq.to(in_dt), dk.to(in_dt), dv.to(in_dt), dw1.to(w_dt), dw2.to(w_dt)


# ------------------------------------------------------------------------------------------------- conv branch
def _taps(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """t[b, c, i, j] = sum_{y,x} xpad[b, c, y+i, x+j] e[b, c, y, x] (3x3 taps, zero padding 1) -> (B, d, 3, 3).

    One strided view of the padded map (row taps i, rows y, column taps j, columns x) times e, reduced over y, x:
    no im2col copy and no loop over taps.
    """
    b, d, h, w = x.shape
    if exporting():  # ONNX has no strided views: the nine shifted windows, one at a time
        xp = F.pad(x, (1, 1, 1, 1))
        taps = [(xp[:, :, i:i + h, j:j + w] * e).sum((2, 3)) for i in range(3) for j in range(3)]
        return torch.stack(taps, -1).unflatten(-1, (3, 3))
    xp = F.pad(x, (1, 1, 1, 1)).contiguous()  # as_strided needs known strides (also under torch.compile)
    s = xp.stride()
    win = xp.as_strided((b, d, 3, h, 3, w), (s[0], s[1], s[2], s[2], s[3], s[3]))
    return (win * e[:, :, None, :, None, :]).sum((3, 5))


def _dwconv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-sample depthwise 3x3 cross-correlation, x (B, d, H, W), w (B, d, 3, 3)."""
    b, d, h, wd = x.shape
    # the nine shifted taps instead of a grouped conv: ONNX's Conv needs a static group count, and inductor fuses
    # the taps (its grouped-conv fallback fails under dynamic shapes: `cannot determine truth value of Relational`)
    if exporting() or torch.compiler.is_compiling():
        xp = F.pad(x, (1, 1, 1, 1))
        return sum(xp[:, :, i:i + h, j:j + wd] * w[:, :, i, j, None, None] for i in range(3) for j in range(3))
    if b * d == 0:  # an empty batch: conv2d refuses groups=0
        return x.new_zeros(x.shape)
    return F.conv2d(x.reshape(1, b * d, h, wd), w.reshape(b * d, 1, 3, 3), padding=1, groups=b * d).reshape(b, d, h, wd)


def dwconv_fwd(q, k, v, w3, scale: float, normalize_grad: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out in q's dtype, raw inner gradient G (B, d, 3, 3) in the compute dtype)."""
    out_dt = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    b, d, h, w = k.shape
    g = _taps(k, v) * (-scale / (h * w))
    w3n = w3.to(dt).reshape(1, d, 3, 3) - (normalize_columns(g, (-2, -1)) if normalize_grad else g)
    out = _dwconv(q, w3n)
    return out.to(out_dt), g


def dwconv_bwd(do, q, k, v, w3, g, scale: float, normalize_grad: bool = True):
    in_dt, w_dt = q.dtype, w3.dtype
    dt = compute_dtype(q.dtype)
    do, q, k, v, g = do.to(dt), q.to(dt), k.to(dt), v.to(dt), g.to(dt)
    b, d, h, w = k.shape
    c = -scale / (h * w)
    w3n = w3.to(dt).reshape(1, d, 3, 3) - (normalize_columns(g, (-2, -1)) if normalize_grad else g)
    dq = _dwconv(do, w3n.flip(-2, -1).expand(b, d, 3, 3))
    dwn = _taps(q, do)
    dg = normalize_columns_bwd(g, -dwn, (-2, -1)) if normalize_grad else -dwn
    dk = _dwconv(v, dg.flip(-2, -1)) * c
    dv = _dwconv(k, dg) * c
    dw3 = dwn.sum(0).reshape(d, 1, 3, 3)
    return dq.to(in_dt), dk.to(in_dt), dv.to(in_dt), dw3.to(w_dt)


# ---------------------------------------------------------------------------------------------- autograd glue
SwiGLUTTT = make_function("SwiGLUTTT", swiglu_fwd, swiglu_bwd, 2)
DWConvTTT = make_function("DWConvTTT", dwconv_fwd, dwconv_bwd, 1)


def swiglu_ttt_torch(q, k, v, w1, w2, scale: float, normalize_grad: bool = True) -> torch.Tensor:
    """ViT3 SwiGLU inner step + apply (same signature as ``swiglu_ttt_reference``), recomputing backward."""
    return SwiGLUTTT.apply(q, k, v, w1, w2, float(scale), bool(normalize_grad))


def dwconv_ttt_torch(q, k, v, w3, scale: float, normalize_grad: bool = True) -> torch.Tensor:
    """ViT3 3x3 depthwise-conv inner step + apply (same signature as ``dwconv_ttt_reference``)."""
    return DWConvTTT.apply(q, k, v, w3, float(scale), bool(normalize_grad))


# ------------------------------------------------------------------------------- qkv projection + both branches
def qkv_forward(x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize_grad,
                swiglu_f=None, dwconv_f=None):
    """Projection + both inner steps, no autograd: (out (B, N, C + d), G_swiglu, G_conv).

    The PyTorch SwiGLU step writes straight into the heads-merged output buffer (no head-merge copy, no concat);
    other implementations (Triton, custom ops) return their own tensor, copied in.
    """
    swiglu_f, dwconv_f = swiglu_f or swiglu_fwd, dwconv_f or dwconv_fwd
    # the projection follows the caller's autocast (replayed in the backward); the inner steps do not
    (q1, k1, v1), (q2, k2, v2) = qkv_split(x, weight, bias, feat_size, heads, cos, sin)
    b, n, c = x.shape
    d = c // heads
    if exporting():  # a traced graph: the heads merged and concatenated, no buffer written through views
        with _autocast(x.device):
            x1, g1 = swiglu_f(q1, k1, v1, w1, w2, scale, normalize_grad)
            x2, g3 = dwconv_f(q2, k2, v2, w3, scale, normalize_grad)
        return torch.cat([x1.transpose(1, 2).flatten(2), x2.flatten(2).transpose(1, 2)], -1), g1, g3
    out = q1.new_empty(b, n, c + d)
    out1 = out[..., :c].unflatten(-1, (heads, d)).transpose(1, 2)
    with _autocast(x.device):
        if swiglu_f is swiglu_fwd:
            _, g1 = swiglu_f(q1, k1, v1, w1, w2, scale, normalize_grad, out=out1)
        else:
            x1, g1 = swiglu_f(q1, k1, v1, w1, w2, scale, normalize_grad)
            out1.copy_(x1)
        x2, g3 = dwconv_f(q2, k2, v2, w3, scale, normalize_grad)
        out[..., c:].copy_(x2.flatten(2).transpose(1, 2))
    return out, g1, g3


def make_qkv_function(name: str, swiglu_f, swiglu_b, dwconv_f, dwconv_b):
    """autograd.Function for ``[swiglu_ttt | dwconv_ttt](split(x W^T + b))`` that stores only x and small tensors.

    Saved per block: the projection input x (B, N, C) (which the projection would store anyway), the weights, and the
    raw inner gradients (B, heads, d, 2d) and (B, d, 3, 3).  The backward recomputes the projection (one GEMM), the
    RoPE and the inner steps, so the (B, N, 3C + 3d) projection output and every inner intermediate never outlive
    the block's forward.
    """

    def forward(ctx, x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize_grad):
        out, g1, g3 = qkv_forward(x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize_grad,
                                  swiglu_f, dwconv_f)
        ctx.save_for_backward(x, weight, bias, w1, w2, w3, g1, g3, cos, sin)
        ctx.args = (feat_size, heads, scale, normalize_grad)
        ctx.amp = _autocast_state(x.device)
        return out

    def backward(ctx, dout):
        x, weight, bias, w1, w2, w3, g1, g3, cos, sin = ctx.saved_tensors
        feat_size, heads, scale, normalize_grad = ctx.args
        b, n, c = x.shape
        h, w = feat_size
        d = c // heads
        with torch.no_grad(), _autocast(x.device, *ctx.amp):
            (q1, k1, v1), (q2, k2, v2) = qkv_split(x, weight, bias, feat_size, heads, cos, sin)
        with torch.no_grad(), _autocast(x.device):
            dx1 = dout[..., :c].reshape(b, n, heads, d).transpose(1, 2)
            dq1, dk1, dv1, dw1, dw2 = swiglu_b(dx1, q1, k1, v1, w1, w2, g1, scale, normalize_grad)
            del q1, k1, v1
            dx2 = dout[..., c:].transpose(1, 2).reshape(b, d, h, w)
            dq2, dk2, dv2, dw3 = dwconv_b(dx2, q2, k2, v2, w3, g3, scale, normalize_grad)
            del q2, k2, v2
            # assemble d(qkv) in place: no head-merge copies next to the concatenated buffer
            dqkv = dq1.new_empty(b, n, 3 * c + 3 * d)
            parts = [dq1, dk1, dv1]
            del dq1, dk1, dv1
            for i in range(3):
                dst = dqkv[..., i * c:(i + 1) * c]
                if cos is not None and i < 2:  # RoPE is a rotation: its transpose turns by -angle
                    dst.copy_(rope_2d(parts[i].transpose(1, 2).reshape(b, h, w, c), cos, -sin).reshape(b, n, c))
                else:
                    dst.unflatten(-1, (heads, d)).copy_(parts[i].transpose(1, 2))
                parts[i] = None
            for i, t in enumerate((dq2, dk2, dv2)):
                dqkv[..., 3 * c + i * d:3 * c + (i + 1) * d].copy_(t.flatten(2).transpose(1, 2))
            del dq2, dk2, dv2
        with torch.no_grad(), _autocast(x.device, *ctx.amp):  # projection backward in the forward's precision
            dx = (dqkv @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
            dweight = (dqkv.reshape(-1, dqkv.shape[-1]).t() @ x.reshape(-1, c)).to(weight.dtype)
            dbias = dqkv.sum((0, 1)).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, dw1, dw2, dw3, None, None, None, None, None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


QKVTTT = make_qkv_function("QKVTTT", swiglu_fwd, swiglu_bwd, dwconv_fwd, dwconv_bwd)


def qkv_ttt_torch(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
                  cos=None, sin=None) -> torch.Tensor:
    """Projection + both inner steps with the recomputing backward; (B, N, C) -> (B, N, C + d)."""
    # feat_size stays symbolic under torch.compile(dynamic=True) / export (int() would fix it to the traced size)
    args = (x, weight, bias, w1, w2, w3, cos, sin, (feat_size[0], feat_size[1]), int(heads), float(scale),
            bool(normalize_grad))
    if exporting() or not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in args[:8]):
        return qkv_forward(*args)[0]  # inference or export: no autograd.Function
    return QKVTTT.apply(*args)
