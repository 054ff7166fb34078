"""Key instance-norm of the T5 and DiT5 mixers: per sample and channel, normalise (B, N, C) over the N tokens.

    y = (x - mean) / sqrt(var + eps),  mean / var (biased) over N, statistics in float32, no affine.

``naive.key_norm_reference`` is the plain form (autograd through it, ``torch_naive``).  ``key_norm_fwd`` /
``key_norm_bwd`` here are the lean path: the forward returns y and the fp32 statistics (mean, rstd), (B, C) each; the backward stores
only x and the statistics and recomputes x^ = (x - mean) rstd:
    dx = rstd (dy - mean_N(dy) - x^ mean_N(dy x^)).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

__all__ = ["key_norm_fwd", "key_norm_bwd", "key_norm_torch", "check_key_norm", "stat_dtype", "identity_taps",
           "check_qk_norm_fold", "qk_norm_fold_fwd", "check_qkv_fold", "qkv_fold_fwd", "qkv_fold_bwd"]


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_key_norm(x: torch.Tensor, eps: float) -> None:
    if x.dim() != 3:
        raise ValueError(f"key_instance_norm expects (B, N, C) tokens, got shape {tuple(x.shape)}")
    if not eps > 0:
        raise ValueError(f"key_instance_norm eps must be > 0, got {eps}")


def key_norm_fwd(x: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in x's dtype, mean (B, C) fp32, rstd (B, C) fp32)."""
    xf = x.to(stat_dtype(x.dtype))
    mean = xf.mean(dim=1)
    var = (xf - mean[:, None]).square().mean(dim=1)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean[:, None]) * rstd[:, None]
    return (y if y.dtype == x.dtype else y.to(x.dtype)), mean, rstd


def key_norm_bwd(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    dt = stat_dtype(x.dtype)
    xh = (x.to(dt) - mean[:, None]) * rstd[:, None]
    dyf = dy.to(dt)
    dx = rstd[:, None] * (dyf - dyf.mean(dim=1, keepdim=True) - xh * (dyf * xh).mean(dim=1, keepdim=True))
    return dx.to(x.dtype)


def make_function(name: str, fwd, bwd):
    def forward(ctx, x, eps):
        y, mean, rstd = fwd(x, eps)
        ctx.save_for_backward(x, mean, rstd)
        return y

    def backward(ctx, dy):
        return bwd(dy, *ctx.saved_tensors), None

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


KeyNorm = make_function("KeyNorm", key_norm_fwd, key_norm_bwd)


def key_norm_torch(x: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    """Lean PyTorch path: stores x (a view the mixer keeps anyway) and 2 x C fp32 statistics per sample."""
    check_key_norm(x, eps)
    return KeyNorm.apply(x, float(eps))


# ------------------------------------------- [q | key norm(k)] for one depthwise conv over both (T5 / DiT5 mixers)
def identity_taps(w: torch.Tensor) -> torch.Tensor:
    """The depthwise kernel shaped like ``w`` (C, 1, kh, kw, odd) that copies its input: 1 at the centre tap (built
    by padding, no item assignment, so FX, TorchScript and both ONNX exporters trace it)."""
    ph, pw = w.shape[2] // 2, w.shape[3] // 2
    return F.pad(torch.ones_like(w[:, :, :1, :1]), (pw, pw, ph, ph))


def check_qk_norm_fold(q, k, eps: float, wq, bq, wk, bk) -> None:
    check_key_norm(k, eps)
    c = k.shape[-1]
    if q.shape != k.shape or q.dtype != k.dtype:
        raise ValueError(f"q must match k's shape and dtype {tuple(k.shape)}, {k.dtype}; got {tuple(q.shape)}, "
                         f"{q.dtype}")
    if wq.shape != wk.shape or wq.dim() != 4 or wq.shape[:2] != (c, 1) or wq.shape[2] % 2 == 0 or \
            wq.shape[3] % 2 == 0 or bq.shape != (c,) or bk.shape != (c,):
        raise ValueError(f"the q and k convs must be depthwise over the {c} channels with odd taps and biases, got "
                         f"weights {tuple(wq.shape)}, {tuple(wk.shape)}, biases {tuple(bq.shape)}, {tuple(bk.shape)}")


def qk_norm_fold_fwd(q: torch.Tensor, k: torch.Tensor, eps: float, wq: torch.Tensor, bq: torch.Tensor,
                     wk: torch.Tensor, bk: torch.Tensor, copy_qk: bool = False):
    """([q | key norm(k)] (B, N, 2C), the stacked conv taps with the identity folded in (2C, 1, kh, kw), the stacked
    biases (2C,), mean, rstd, with ``copy_qk`` copies of q and k): one depthwise conv of the result over 2C channels
    is ``q + conv_q(q)`` and ``kn + conv_k(kn)`` side by side.  The PyTorch form of the Triton kernel's launch."""
    y, mean, rstd = key_norm_fwd(k, eps)
    w = torch.cat([wq, wk])
    copies = tuple(t.clone(memory_format=torch.contiguous_format) for t in (q, k)) if copy_qk else ()
    return (torch.cat([q, y], -1), w + identity_taps(w), torch.cat([bq, bk]), mean, rstd) + copies


def qk_norm_fold_bwd(dy: torch.Tensor, k: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, dqa: torch.Tensor,
                     dka: torch.Tensor):
    """(dq, dk) of :func:`qk_norm_fold_fwd` with ``copy_qk``, the copies' gradients ``dqa``, ``dka`` added."""
    c = k.shape[-1]
    return dy[..., :c] + dqa, key_norm_bwd(dy[..., c:], k, mean, rstd) + dka


# ----------------------- DiT5: the q / k affine, key norm, both residual convs and the attention's copies from one qkv
def check_qkv_fold(qkv, eps: float, scale, offset, wq, bq, wk, bk, h: int, w: int) -> int:
    """C of a (B, N, 3C) qkv output of an h x w map; checks the rest as :func:`check_qk_norm_fold` and the affine."""
    if qkv.dim() != 3 or qkv.shape[-1] % 3 or qkv.shape[1] != h * w:
        raise ValueError(f"qkv_fold expects a (B, N, 3C) qkv output of the {h} x {w} map, got shape "
                         f"{tuple(qkv.shape)}")
    c = qkv.shape[-1] // 3
    if scale.shape != (1, 1, c, 2) or offset.shape != (1, 1, c, 2):
        raise ValueError(f"the q / k affine must be (1, 1, {c}, 2), got {tuple(scale.shape)}, {tuple(offset.shape)}")
    check_qk_norm_fold(qkv[..., :c], qkv[..., c:2 * c], eps, wq, bq, wk, bk)
    return c


def _as_map(z: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return z.transpose(1, 2).reshape(z.shape[0], z.shape[2], h, w)


def _as_tokens(z: torch.Tensor) -> torch.Tensor:
    return z.flatten(2).transpose(1, 2)


def qkv_fold_fwd(qkv: torch.Tensor, eps: float, scale: torch.Tensor, offset: torch.Tensor, wq: torch.Tensor,
                 bq: torch.Tensor, wk: torch.Tensor, bk: torch.Tensor, h: int, w: int):
    """DiT5's TTT inputs from the qkv output (B, N, 3C) of an h x w map: ([q2 | k2] (B, N, 2C), mean, rstd of k',
    copies of q, k, v, v), q2 = q' + conv_q(q') + b_q, k2 = kn + conv_k(kn) + b_k ('same' depthwise convs),
    q' = q s_q + o_q, kn = key norm(k s_k + o_k) (``scale``, ``offset`` (1, 1, C, 2), [..., 0] for q), computed in
    the statistics' dtype.  The PyTorch form of the Triton kernel's launch."""
    c = qkv.shape[-1] // 3
    dt = stat_dtype(qkv.dtype)
    q, k, v = qkv.to(dt).split(c, -1)
    qa = q * scale[..., 0].to(dt) + offset[..., 0].to(dt)
    kn, mean, rstd = key_norm_fwd(k * scale[..., 1].to(dt) + offset[..., 1].to(dt), eps)
    pad = (wq.shape[2] // 2, wq.shape[3] // 2)
    z = _as_map(torch.cat([qa, kn], -1), h, w)
    y = z + F.conv2d(z, torch.cat([wq, wk]).to(dt), torch.cat([bq, bk]).to(dt), padding=pad, groups=2 * c)
    copies = tuple(t.to(qkv.dtype).contiguous() for t in (q, k, v, v.clone()))
    return (_as_tokens(y).to(qkv.dtype), mean, rstd) + copies


def qkv_fold_bwd(dy: torch.Tensor, qkv: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor,
                 offset: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, h: int, w: int, dqc: torch.Tensor,
                 dkc: torch.Tensor, dvc: torch.Tensor, dvt: torch.Tensor):
    """(d qkv, (B, R) per-sample sums of the parameters' gradients laid out [scale | offset | w_q | b_q | w_k | b_k],
    each flattened in its parameter's layout) of :func:`qkv_fold_fwd`, the copies' gradients ``dqc .. dvt`` added."""
    c = qkv.shape[-1] // 3
    dt = stat_dtype(qkv.dtype)
    q, k, _ = qkv.to(dt).split(c, -1)
    s, o = scale.to(dt), offset.to(dt)
    qa, ka = q * s[..., 0] + o[..., 0], k * s[..., 1] + o[..., 1]
    kn = (ka - mean.to(dt)[:, None]) * rstd.to(dt)[:, None]
    pad = (wq.shape[2] // 2, wq.shape[3] // 2)
    wf = torch.cat([wq, wk]).to(dt)
    g = _as_map(dy.to(dt), h, w)
    z = _as_map(torch.cat([qa, kn], -1), h, w)
    dz = _as_tokens(g + torch.nn.grad.conv2d_input(z.shape, wf, g, padding=pad, groups=2 * c))
    dw = torch.stack([torch.nn.grad.conv2d_weight(z[i:i + 1], wf.shape, g[i:i + 1], padding=pad, groups=2 * c)
                      for i in range(z.shape[0])])  # per sample, (B, 2C, 1, kh, kw)
    db = g.sum((2, 3))
    dqa, dka = dz[..., :c], key_norm_bwd(dz[..., c:], ka, mean.to(dt), rstd.to(dt))
    dqkv = torch.cat([dqa * s[..., 0] + dqc, dka * s[..., 1] + dkc, dvc + dvt], -1).to(qkv.dtype)
    ds = torch.stack([(dqa * q).sum(1), (dka * k).sum(1)], -1)
    do = torch.stack([dqa.sum(1), dka.sum(1)], -1)
    b = qkv.shape[0]
    return dqkv, torch.cat([ds.reshape(b, -1), do.reshape(b, -1), dw[:, :c].reshape(b, -1), db[:, :c],
                            dw[:, c:].reshape(b, -1), db[:, c:]], 1)
