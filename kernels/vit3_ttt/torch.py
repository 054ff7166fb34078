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

from ..backend import exporting, tracing
from ..utils import autocast_state as _autocast_state
from ..utils import compute_dtype, make_function
from ..utils import no_autocast as _autocast
from ..rope import rope_2d
from .common import backward_inputs, qkv_split

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
    return _scaled_norm_bwd(g, -dghat, n, n + 1.0, 1.0, dim)


def _eager() -> bool:
    """Buffers written through strided views and in-place chains (``out=``); torch.compile and export get the
    functional forms (inductor: no in-place op on a view; dynamo: no strided ``out=``; ONNX: no strided views)."""
    return not tracing()


def _step(w: torch.Tensor, r: torch.Tensor, c: float, normalize: bool, dim) -> torch.Tensor:
    """W' = W - N(c r), N(g) = g / (||g|| + 1) over ``dim``, with the scale c folded into the normalisation:
    c r / (|c| ||r|| + 1) = sign(c) r / (||r|| + 1/|c|) (norm, add, addcdiv: three launches)."""
    if not normalize or c == 0.0:
        return torch.add(w, r, alpha=-c)
    n = torch.linalg.vector_norm(r, dim=dim, keepdim=True) + 1.0 / abs(c)
    if exporting():  # TorchScript's ONNX exporter has no addcdiv
        return w - r / n if c > 0 else w + r / n
    return torch.addcdiv(w, r, n, value=-1.0 if c > 0 else 1.0)


def _scaled_norm_bwd(g, dwn, n, np1, c: float, dim) -> torch.Tensor:
    """c dG for W' = W - N(g) and dW' given: c (g <dW', g> / (n (n+1)) - dW') / (n+1), 0 where n = 0 (there g's
    column is 0, so the dot is too).  ``n`` (the norm of g) and ``np1`` (n + 1) are consumed."""
    u = (dwn * g).sum(dim, keepdim=True).div_(n.clamp_min_(torch.finfo(n.dtype).tiny).mul_(np1))
    return torch.addcmul(dwn, g, u, value=-1.0).div_(np1.div_(-c))


def _halves(x: torch.Tensor, d: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return x[..., :d], x[..., d:]


def _silu_gates(z: torch.Tensor) -> torch.Tensor:
    """[silu(z2), z1 silu'(z2)] for z = [z1 | z2] (the SwiGLU output's derivatives by its two halves)."""
    d = z.shape[-1] // 2
    z1, z2 = _halves(z, d)
    if _eager():  # written into one buffer by ATen's silu kernels: two launches
        e = torch.empty_like(z)
        torch.ops.aten.silu.out(z2, out=e[..., :d])
        torch.ops.aten.silu_backward.grad_input(z1, z2, grad_input=e[..., d:])
        return e
    s = torch.sigmoid(z2)
    return torch.cat([z2 * s, z1 * s * (1.0 + z2 * (1.0 - s))], dim=-1)


def _times_halves(e: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """e (.., 2d) times v (.., d) in both halves (in place in eager)."""
    if _eager():
        e.unflatten(-1, (2, -1)).mul_(v.unsqueeze(-2))
        return e
    return (e.unflatten(-1, (2, -1)) * v.unsqueeze(-2)).flatten(-2)


def _foldable(t: torch.Tensor) -> torch.Tensor:
    """t (B, heads, N, d), copied once if matmul could not fold its batch dims into one without a copy (a strided
    head view of the projection with B > 1): for an operand of several GEMMs, one copy instead of one per GEMM."""
    return t if t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1) else t.contiguous()


def _packed_maps(q2: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor):
    """The conv branch's q, k, v (B, d, H, W) as one contiguous (3, B, d, H, W) copy when B > 1 in eager: a
    depthwise conv over B x d groups needs each map contiguous, and strided views of the projection cost one copy
    each (three in the forward, more in the backward) where one stack serves them all."""
    if q2.shape[0] == 1 or not _eager():
        return q2, k2, v2
    # into a contiguous buffer: stack would keep the views' channels-last-like strides
    return tuple(torch.stack([q2, k2, v2], out=q2.new_empty((3,) + tuple(q2.shape))))


def _matmul(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)


# ----------------------------------------------------------------------------------------------- SwiGLU branch
def swiglu_update(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """Raw inner gradient G = c k^T [v silu(z2), v z1 silu'(z2)], (B, heads, d, 2d), in k's dtype (no autograd)."""
    return (k.transpose(-2, -1) @ _times_halves(_silu_gates(k @ w), v)) * (-scale / k.shape[-2])


def swiglu_apply(q: torch.Tensor, wn: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = (q W1') * silu(q W2'), written into ``out`` (any strided (B, heads, N, d) view) when given."""
    d = q.shape[-1]
    y = q @ wn
    if not _eager():  # no in-place op on a view (inductor), no strided out= (dynamo)
        res = y[..., :d] * F.silu(y[..., d:])
        return res if out is None else out.copy_(res)
    y2 = F.silu(y[..., d:], inplace=True)
    if out is None:
        return y[..., :d] * y2
    return torch.mul(y[..., :d], y2, out=out)


def swiglu_fwd(q, k, v, w1, w2, scale: float, normalize_grad: bool = True, out: Optional[torch.Tensor] = None,
               keep_g: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns (out in q's dtype, raw inner gradient G in the compute dtype; None with ``keep_g=False``, which
    folds the scale into the normalisation: one launch fewer); ``out=`` receives the result."""
    out_dt = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), _foldable(k.to(dt)), v.to(dt)
    c = -scale / k.shape[-2]
    w = torch.cat([w1, w2], dim=-1).to(dt)
    r = k.transpose(-2, -1) @ _times_halves(_silu_gates(k @ w), v)  # G / c
    g = None
    if keep_g:  # the kept G = c r, normalised as it is
        g = r = r * c
        c = 1.0
    res = swiglu_apply(q, _step(w, r, c, normalize_grad, -2), out)
    return (res if out is not None else res.to(out_dt)), g


def swiglu_bwd(do, q, k, v, w1, w2, g, scale: float, normalize_grad: bool = True, out=None):
    """Gradients (dq, dk, dv, dw1, dw2) from the saved inputs and the raw inner gradient ``g``; ``out`` (three
    (B, heads, N, d) views) receives dq, dk, dv in eager.

    Both halves of every N x 2d product are one GEMM (dy W'^T, q^T dy, k dG, [A | dZ] [dG | W]^T, k^T dZ), and
    c dG is formed once (so dA, dk, dv, dz carry the scale without further launches)."""
    in_dt, w_dt = q.dtype, w1.dtype
    dt = compute_dtype(q.dtype)
    do, q, k, v, g = do.to(dt), _foldable(q.to(dt)), _foldable(k.to(dt)), v.to(dt), g.to(dt)
    eager = _eager()
    out = out if (out is not None and eager and in_dt == dt) else (None, None, None)
    d, n = q.shape[-1], q.shape[-2]
    c = -scale / n
    w = torch.cat([w1, w2], dim=-1).to(dt)
    # apply step: out = y1 * silu(y2), y = q W'
    if normalize_grad:
        nrm = torch.linalg.vector_norm(g, dim=-2, keepdim=True)
        np1 = nrm + 1.0
        wn = torch.addcdiv(w, g, np1, value=-1.0)
    else:
        wn = w - g
    dy = _times_halves(_silu_gates(q @ wn), do)            # [dO silu(y2), dO y1 silu'(y2)]
    dq = _matmul(dy, wn.transpose(-2, -1), out[0])
    dwn = q.transpose(-2, -1) @ dy
    del dy
    p = _scaled_norm_bwd(g, dwn, nrm, np1, c, -2) if normalize_grad else dwn * -c   # c dG
    # update step: G = c k^T A(z = k W), A = v [silu(z2), z1 silu'(z2)]
    z = k @ w
    z1, z2 = _halves(z, d)
    s = torch.sigmoid(z2)
    ds1 = torch.addcmul(s, s, s, value=-1.0)                # sigmoid'
    dsilu = torch.addcmul(s, z2, ds1)                        # silu' = s + z2 sigmoid'
    if eager:
        e = torch.empty_like(z)                              # E = [silu(z2), z1 silu'(z2)]
        torch.mul(z2, s, out=e[..., :d])
        torch.mul(z1, dsilu, out=e[..., d:])
        az = z.new_empty(*z.shape[:-1], 4 * d)               # [A | dZ]
        torch.mul(e.unflatten(-1, (2, d)), v.unsqueeze(-2), out=az[..., :2 * d].unflatten(-1, (2, d)))
    else:
        e = torch.cat([z2 * s, z1 * dsilu], dim=-1)
        az = _times_halves(e, v)                             # A
    del s
    da = k @ p                                               # dA (c folded in p)
    if out[2] is not None:
        torch.sum((da * e).unflatten(-1, (2, d)), -2, out=out[2])
        dv = out[2]
    else:
        dv = (da * e).unflatten(-1, (2, d)).sum(-2)
    # z1 silu''(z2), silu'' = sigmoid' (2 + z2 (1 - 2 s)) = sigmoid' (2 + z2 - 2 silu)
    d2 = torch.add(z2, e[..., :d], alpha=-2.0).add_(2.0).mul_(ds1).mul_(z1)
    del e, ds1
    dav = da.unflatten(-1, (2, d)) * v.unsqueeze(-2)         # [dA1 v, dA2 v]
    da1v, da2v = dav[..., 0, :], dav[..., 1, :]
    if eager:                                                # dz1 = dA2 v silu', dz2 = dA1 v silu' + dA2 v z1 silu''
        dz = az[..., 2 * d:]
        torch.mul(da2v, dsilu, out=dz[..., :d])
        torch.mul(da1v, dsilu, out=dz[..., d:]).addcmul_(da2v, d2)
    else:
        dz = torch.cat([da2v * dsilu, torch.addcmul(da1v * dsilu, da2v, d2)], dim=-1)
        az = torch.cat([az, dz], dim=-1)
    del dav, d2, dsilu, z
    dk = _matmul(az, torch.cat([p, w.expand_as(p)], dim=-1).transpose(-2, -1), out[1])   # c A dG^T + dz W^T
    dw = (k.transpose(-2, -1) @ dz).add_(dwn)
    # a shared weight's gradient summed over the batch, each half into its own contiguous tensor
    dw1, dw2 = (t.sum(0, keepdim=True) if like.shape[0] == 1 else t for t, like in zip(_halves(dw, d), (w1, w2)))
    return dq.to(in_dt), dk.to(in_dt), dv.to(in_dt), dw1.to(w_dt), dw2.to(w_dt)


# ------------------------------------------------------------------------------------------------- conv branch
def _taps(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """t[b, c, i, j] = sum_{y,x} xpad[b, c, y+i, x+j] e[b, c, y, x] (3x3 taps, zero padding 1) -> (B, d, 3, 3).

    Eager: one grouped convolution of x with e as the per-channel kernel (10x faster than the strided product on
    the CPU at 14x14).  torch.compile: one strided view of the padded map (row taps i, rows y, column taps j,
    columns x) times e, reduced over y, x (inductor's grouped-conv fallback fails under dynamic shapes).
    """
    b, d, h, w = x.shape
    if exporting():  # ONNX has no strided views: the nine shifted windows, one at a time
        xp = F.pad(x, (1, 1, 1, 1))
        taps = [(xp[:, :, i:i + h, j:j + w] * e).sum((2, 3)) for i in range(3) for j in range(3)]
        return torch.stack(taps, -1).unflatten(-1, (3, 3))
    if not torch.compiler.is_compiling():
        if b * d == 0:
            return x.new_zeros(b, d, 3, 3)
        return F.conv2d(x.reshape(1, b * d, h, w), e.reshape(b * d, 1, h, w), padding=1,
                        groups=b * d).reshape(b, d, 3, 3)
    xp = F.pad(x, (1, 1, 1, 1)).contiguous()  # as_strided needs known strides (also under torch.compile)
    s = xp.stride()
    win = xp.as_strided((b, d, 3, h, 3, w), (s[0], s[1], s[2], s[2], s[3], s[3]))
    return (win * e[:, :, None, :, None, :]).sum((3, 5))


def _dwconv(x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """Per-sample depthwise 3x3 cross-correlation, x (B, d, H, W), w (B, d, 3, 3); ``transposed``: with the kernel
    flipped (the correlation's transpose, one conv_transpose2d in eager)."""
    b, d, h, wd = x.shape
    # the nine shifted taps instead of a grouped conv: ONNX's Conv needs a static group count, and inductor fuses
    # the taps (its grouped-conv fallback fails under dynamic shapes: `cannot determine truth value of Relational`)
    if tracing():
        w = w.flip(-2, -1) if transposed else w
        xp = F.pad(x, (1, 1, 1, 1))
        return sum(xp[:, :, i:i + h, j:j + wd] * w[:, :, i, j, None, None] for i in range(3) for j in range(3))
    if b * d == 0:  # an empty batch: conv2d refuses groups=0
        return x.new_zeros(x.shape)
    conv = F.conv_transpose2d if transposed else F.conv2d
    return conv(x.reshape(1, b * d, h, wd), w.expand(b, d, 3, 3).reshape(b * d, 1, 3, 3), padding=1,
                groups=b * d).reshape(b, d, h, wd)


def dwconv_fwd(q, k, v, w3, scale: float, normalize_grad: bool = True,
               keep_g: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns (out in q's dtype, raw inner gradient G (B, d, 3, 3) in the compute dtype; None with
    ``keep_g=False``, which folds the scale into the normalisation)."""
    out_dt = q.dtype
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    b, d, h, w = k.shape
    r, c, g = _taps(k, v), -scale / (h * w), None
    if keep_g:
        g = r = r * c
        c = 1.0
    out = _dwconv(q, _step(w3.to(dt).reshape(1, d, 3, 3), r, c, normalize_grad, (-2, -1)))
    return out.to(out_dt), g


def dwconv_bwd(do, q, k, v, w3, g, scale: float, normalize_grad: bool = True):
    in_dt, w_dt = q.dtype, w3.dtype
    dt = compute_dtype(q.dtype)
    do, q, k, v, g = do.to(dt), q.to(dt), k.to(dt), v.to(dt), g.to(dt)
    b, d, h, w = k.shape
    c = -scale / (h * w)
    w3 = w3.to(dt).reshape(1, d, 3, 3)
    if normalize_grad:
        nrm = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)
        np1 = nrm + 1.0
        w3n = torch.addcdiv(w3, g, np1, value=-1.0)
    else:
        w3n = w3 - g
    dq = _dwconv(do, w3n, transposed=True)
    dwn = _taps(q, do)
    p = _scaled_norm_bwd(g, dwn, nrm, np1, c, (-2, -1)) if normalize_grad else dwn * -c   # c dG
    dk = _dwconv(v, p, transposed=True)
    dv = _dwconv(k, p)
    dw3 = dwn.sum(0).reshape(d, 1, 3, 3)
    return dq.to(in_dt), dk.to(in_dt), dv.to(in_dt), dw3.to(w_dt)


# ---------------------------------------------------------------------------------------------- autograd glue
def step_functions(name: str, swiglu_fwd, swiglu_bwd, dwconv_fwd, dwconv_bwd):
    """The differentiable SwiGLU and conv inner steps + apply (the references' signatures) over a ``*_fwd`` /
    ``*_bwd`` pair each (this file's, or the Triton kernels'), via ``utils.make_function``."""
    swiglu_fn = make_function(f"SwiGLUTTT{name}", swiglu_fwd, swiglu_bwd, 2)
    dwconv_fn = make_function(f"DWConvTTT{name}", dwconv_fwd, dwconv_bwd, 1)

    def swiglu_ttt(q, k, v, w1, w2, scale: float, normalize_grad: bool = True) -> torch.Tensor:
        return swiglu_fn.apply(q, k, v, w1, w2, float(scale), bool(normalize_grad))

    def dwconv_ttt(q, k, v, w3, scale: float, normalize_grad: bool = True) -> torch.Tensor:
        return dwconv_fn.apply(q, k, v, w3, float(scale), bool(normalize_grad))

    return swiglu_ttt, dwconv_ttt


#: ViT3's SwiGLU and 3x3 depthwise-conv inner steps + apply with the recomputing backward
swiglu_ttt_torch, dwconv_ttt_torch = step_functions("", swiglu_fwd, swiglu_bwd, dwconv_fwd, dwconv_bwd)


# ------------------------------------------------------------------------------- qkv projection + both branches
def qkv_forward(x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize_grad,
                swiglu_f=None, dwconv_f=None, keep_g: bool = True, keep_inputs: bool = False, pack=_packed_maps):
    """Projection + both inner steps, no autograd: (out (B, N, C + d), G_swiglu, G_conv); the PyTorch steps
    return no G with ``keep_g=False`` (inference: the scale folds into the normalisation).  ``keep_inputs``: a
    fourth item, the inner steps' inputs (q1, k1, v1, q2, k2, v2) as the backward takes them.  ``pack``: what
    the conv maps go through first (None: the projection's token-major views as they are).

    The PyTorch SwiGLU step writes straight into the heads-merged output buffer (no head-merge copy, no concat);
    other implementations (Triton, custom ops) return their own tensor, copied in.
    """
    swiglu_f, dwconv_f = swiglu_f or swiglu_fwd, dwconv_f or dwconv_fwd
    # the projection follows the caller's autocast (replayed in the backward); the inner steps do not
    (q1, k1, v1), (q2, k2, v2) = qkv_split(x, weight, bias, feat_size, heads, cos, sin)
    b, n, c = x.shape
    d = c // heads
    if pack is not None:
        q2, k2, v2 = pack(q2, k2, v2)
    if exporting():  # a traced graph: the heads merged and concatenated, no buffer written through views
        with _autocast(x.device):
            x1, g1 = swiglu_f(q1, k1, v1, w1, w2, scale, normalize_grad)
            x2, g3 = dwconv_f(q2, k2, v2, w3, scale, normalize_grad)
        out = torch.cat([x1.transpose(1, 2).flatten(2), x2.flatten(2).transpose(1, 2)], -1)
        return (out, g1, g3, (q1, k1, v1, q2, k2, v2)) if keep_inputs else (out, g1, g3)
    out = q1.new_empty(b, n, c + d)
    out1 = out[..., :c].unflatten(-1, (heads, d)).transpose(1, 2)
    with _autocast(x.device):
        if swiglu_f is swiglu_fwd:
            _, g1 = swiglu_f(q1, k1, v1, w1, w2, scale, normalize_grad, out=out1, keep_g=keep_g)
        else:
            x1, g1 = swiglu_f(q1, k1, v1, w1, w2, scale, normalize_grad)
            out1.copy_(x1)
        if dwconv_f is dwconv_fwd:
            x2, g3 = dwconv_f(q2, k2, v2, w3, scale, normalize_grad, keep_g=keep_g)
        else:
            x2, g3 = dwconv_f(q2, k2, v2, w3, scale, normalize_grad)
        out[..., c:].copy_(x2.flatten(2).transpose(1, 2))
    return (out, g1, g3, (q1, k1, v1, q2, k2, v2)) if keep_inputs else (out, g1, g3)


def make_qkv_function(name: str, swiglu_f, swiglu_b, dwconv_f, dwconv_b, pack=_packed_maps):
    """autograd.Function for ``[swiglu_ttt | dwconv_ttt](split(x W^T + b))`` that stores only x and small tensors;
    ``pack``: as :func:`qkv_forward`'s (None for conv steps that read the projection's strided views themselves).

    Saved per block: the projection input x (B, N, C) (which the projection would store anyway), the weights, and the
    raw inner gradients (B, heads, d, 2d) and (B, d, 3, 3).  With ``recompute`` (the default) the backward
    recomputes the projection (one GEMM), the RoPE and the inner steps' inputs, so the (B, N, 3C + 3d) projection
    output never outlives the block's forward; ``recompute=False`` keeps those inputs instead (one GEMM fewer per
    training step, 3.5 C more floats per token stored).  Every inner intermediate is recomputed either way.
    """

    def forward(ctx, x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale, normalize_grad, recompute=True):
        out, g1, g3, inputs = qkv_forward(x, weight, bias, w1, w2, w3, cos, sin, feat_size, heads, scale,
                                          normalize_grad, swiglu_f, dwconv_f, keep_inputs=True, pack=pack)
        ctx.save_for_backward(x, weight, bias, w1, w2, w3, g1, g3, cos, sin, *(() if recompute else inputs))
        ctx.args = (feat_size, heads, scale, normalize_grad)
        ctx.amp = _autocast_state(x.device)
        return out

    def backward(ctx, dout):
        x, weight, bias, w1, w2, w3, g1, g3, cos, sin, *inputs = ctx.saved_tensors
        feat_size, heads, scale, normalize_grad = ctx.args
        b, n, c = x.shape
        h, w = feat_size
        d = c // heads
        q1, k1, v1, q2, k2, v2 = backward_inputs(inputs, x, weight, bias, feat_size, heads, cos, sin, ctx.amp,
                                                 pack)
        del inputs
        with torch.no_grad(), _autocast(x.device):
            dx1 = dout[..., :c].reshape(b, n, heads, d).transpose(1, 2)
            # assemble d(qkv) in place: the PyTorch SwiGLU step writes its gradients straight into it (those that
            # RoPE turns back excepted), other implementations' are copied in
            dqkv = q1.new_empty(b, n, 3 * c + 3 * d)
            dst1 = [dqkv[..., i * c:(i + 1) * c] for i in range(3)]
            into = [None if cos is not None and i < 2 else t.unflatten(-1, (heads, d)).transpose(1, 2)
                    for i, t in enumerate(dst1)]
            if swiglu_b is swiglu_bwd:
                parts = list(swiglu_b(dx1, q1, k1, v1, w1, w2, g1, scale, normalize_grad, out=into))
            else:
                parts = list(swiglu_b(dx1, q1, k1, v1, w1, w2, g1, scale, normalize_grad))
            dw1, dw2 = parts[3:]
            del q1, k1, v1
            dx2 = dout[..., c:].transpose(1, 2).reshape(b, d, h, w)
            dq2, dk2, dv2, dw3 = dwconv_b(dx2, q2, k2, v2, w3, g3, scale, normalize_grad)
            del q2, k2, v2
            for i in range(3):
                dst = dst1[i]
                if cos is not None and i < 2:  # RoPE is a rotation: its transpose turns by -angle
                    dst.copy_(rope_2d(parts[i].transpose(1, 2).reshape(b, h, w, c), cos, -sin).reshape(b, n, c))
                elif parts[i] is not into[i]:
                    into[i].copy_(parts[i])
                parts[i] = None
            for i, t in enumerate((dq2, dk2, dv2)):
                dqkv[..., 3 * c + i * d:3 * c + (i + 1) * d].copy_(t.flatten(2).transpose(1, 2))
            del dq2, dk2, dv2
        with torch.no_grad(), _autocast(x.device, *ctx.amp):  # projection backward in the forward's precision
            dx = (dqkv @ weight).to(x.dtype) if ctx.needs_input_grad[0] else None
            dweight = (dqkv.reshape(-1, dqkv.shape[-1]).t() @ x.reshape(-1, c)).to(weight.dtype)
            dbias = dqkv.sum((0, 1)).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, dw1, dw2, dw3, None, None, None, None, None, None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


QKVTTT = make_qkv_function("QKVTTT", swiglu_fwd, swiglu_bwd, dwconv_fwd, dwconv_bwd)


def qkv_ttt_torch(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
                  cos=None, sin=None, recompute: bool = True) -> torch.Tensor:
    """Projection + both inner steps with the lean backward (``recompute``: of the projection too, see
    :func:`make_qkv_function`); (B, N, C) -> (B, N, C + d)."""
    # feat_size stays symbolic under torch.compile(dynamic=True) / export (int() would fix it to the traced size)
    args = (x, weight, bias, w1, w2, w3, cos, sin, (feat_size[0], feat_size[1]), int(heads), float(scale),
            bool(normalize_grad))
    if exporting() or not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in args[:8]):
        return qkv_forward(*args, keep_g=False)[0]  # inference or export: no autograd.Function
    return QKVTTT.apply(*args, bool(recompute))
