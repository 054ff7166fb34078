"""The adaLN glue of the DiT blocks on (B, N, C) tokens, the PyTorch path (the custom ops' ``triton=False`` branch).

    modulate_norm:              h = LN(x) * (1 + scale) + shift          (LayerNorm without affine parameters)
    gate_residual:              out = x + gate * y
    gate_residual_modulate_norm: x1 = x + gate * y;  h = modulate_norm(x1)

``shift``, ``scale``, ``gate`` are (B, C) vectors broadcast over the N tokens.  Forward and analytic backward
without autograd (the custom ops run below it), computed in float32 (float64 for float64 inputs); the statistics
``mean``, ``rstd`` (B, N) are kept for the backward.  Outputs in the promoted dtype of the inputs, gradients in each
input's own dtype.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["check_modulate_norm", "check_gate_residual", "check_gate_residual_modulate_norm", "compute_dtype",
           "out_dtype", "modulate_norm_fwd", "modulate_norm_bwd", "gate_residual_fwd", "gate_residual_bwd",
           "gate_residual_modulate_norm_fwd", "gate_residual_modulate_norm_bwd"]

_NAME = "adaln"


def _fail(what: str, fix: str) -> None:
    raise ValueError(f"{_NAME}: {what}; {fix}")


def _check_tokens(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        _fail(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}",
              "pass float32, float16, bfloat16 or float64 tokens")
    if t.dim() != 3:
        _fail(f"{name} must be (B, N, C) tokens, got shape {tuple(t.shape)}", "flatten the map to tokens first")


def _check_vectors(x: Tensor, **vectors: Tensor) -> None:
    b, _, c = x.shape
    for name, v in vectors.items():
        if not isinstance(v, Tensor) or not v.is_floating_point():
            _fail(f"{name} must be a floating-point tensor, got {getattr(v, 'dtype', type(v).__name__)}",
                  "pass the float modulation vectors")
        if tuple(v.shape) != (b, c):
            _fail(f"{name} must be (B, C) = ({b}, {c}) for x of shape {tuple(x.shape)}, got {tuple(v.shape)}",
                  "pass one vector per sample with the tokens' channel count")
        if v.device != x.device:
            _fail(f"{name} is on {v.device}, x on {x.device}", "move them to one device")


def check_modulate_norm(x: Tensor, shift: Tensor, scale: Tensor) -> None:
    _check_tokens("x", x)
    _check_vectors(x, shift=shift, scale=scale)


def check_gate_residual(x: Tensor, y: Tensor, gate: Tensor) -> None:
    _check_tokens("x", x)
    _check_tokens("y", y)
    if y.shape != x.shape:
        _fail(f"y {tuple(y.shape)} and x {tuple(x.shape)} differ", "pass the residual branch's output for x")
    if y.device != x.device:
        _fail(f"y is on {y.device}, x on {x.device}", "move them to one device")
    _check_vectors(x, gate=gate)


def check_gate_residual_modulate_norm(x: Tensor, y: Tensor, gate: Tensor, shift: Tensor, scale: Tensor) -> None:
    check_gate_residual(x, y, gate)
    _check_vectors(x, shift=shift, scale=scale)


def out_dtype(*ts: Tensor) -> torch.dtype:
    """Eager type promotion of the inputs (no autocast)."""
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def compute_dtype(*ts: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _col(v: Tensor, dtype: torch.dtype) -> Tensor:
    return v.to(dtype).unsqueeze(1)


def _normalize(xf: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    var, mean = torch.var_mean(xf, -1, correction=0)
    rstd = torch.rsqrt(var + eps)
    return (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1), mean, rstd


def modulate_norm_fwd(x: Tensor, shift: Tensor, scale: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(h, mean, rstd)."""
    cdt = compute_dtype(x, shift, scale)
    xhat, mean, rstd = _normalize(x.to(cdt), eps)
    h = torch.addcmul(_col(shift, cdt), xhat, 1 + _col(scale, cdt))
    return h.to(out_dtype(x, shift, scale)), mean, rstd


def _modulate_norm_grads(dh: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, scale: Tensor, cdt: torch.dtype):
    """(dx, dshift, dscale) in ``cdt``: dshift = sum_n dh, dscale = sum_n dh xhat, and the LayerNorm backward of
    g = dh (1 + scale): dx = rstd (g - mean_c g - xhat mean_c(g xhat))."""
    xhat = (x.to(cdt) - mean.to(cdt).unsqueeze(-1)) * rstd.to(cdt).unsqueeze(-1)
    dhf = dh.to(cdt)
    g = dhf * (1 + _col(scale, cdt))
    dx = rstd.to(cdt).unsqueeze(-1) * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, dhf.sum(1), (dhf * xhat).sum(1)


def modulate_norm_bwd(dh: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, scale: Tensor,
                      shift_dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """(dx, dshift, dscale), each in its input's dtype."""
    dx, dshift, dscale = _modulate_norm_grads(dh, x, mean, rstd, scale, compute_dtype(dh, x, scale))
    return dx.to(x.dtype), dshift.to(shift_dtype), dscale.to(scale.dtype)


def gate_residual_fwd(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    cdt = compute_dtype(x, y, gate)
    return torch.addcmul(x.to(cdt), _col(gate, cdt), y.to(cdt)).to(out_dtype(x, y, gate))


def gate_residual_bwd(g: Tensor, y: Tensor, gate: Tensor) -> Tuple[Tensor, Tensor]:
    """(dy, dgate); dx is g itself."""
    cdt = compute_dtype(g, y, gate)
    gf = g.to(cdt)
    return (gf * _col(gate, cdt)).to(y.dtype), (gf * y.to(cdt)).sum(1).to(gate.dtype)


def gate_residual_modulate_norm_fwd(x: Tensor, y: Tensor, gate: Tensor, shift: Tensor, scale: Tensor,
                                    eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x1, h, mean, rstd): x1 in the dtype eager ``x + gate * y`` has, h normalises x1 as stored."""
    x1 = gate_residual_fwd(x, y, gate)
    h, mean, rstd = modulate_norm_fwd(x1, shift, scale, eps)
    return x1, h, mean, rstd


def gate_residual_modulate_norm_bwd(g_x1: Optional[Tensor], g_h: Optional[Tensor], x1: Tensor, y: Tensor,
                                    gate: Tensor, mean: Tensor, rstd: Tensor, scale: Tensor, x_dtype: torch.dtype,
                                    shift_dtype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dy, dgate, dshift, dscale): d_x1 = g_x1 + modulate_norm's dx of g_h; dx = d_x1, dy = d_x1 gate,
    dgate = sum_n d_x1 y.  Either incoming gradient may be None (zero)."""
    cdt = compute_dtype(x1, y, gate, scale)
    b, _, c = x1.shape
    if g_h is not None:
        d, dshift, dscale = _modulate_norm_grads(g_h, x1, mean, rstd, scale, cdt)
        d = d if g_x1 is None else d + g_x1.to(cdt)
    else:  # a copy: a custom op's output may not alias its input
        d = g_x1.to(cdt, copy=True)
        dshift, dscale = (torch.zeros(b, c, dtype=cdt, device=x1.device) for _ in range(2))
    dy = (d * _col(gate, cdt)).to(y.dtype)
    dgate = (d * y.to(cdt)).sum(1)
    return d.to(x_dtype), dy, dgate.to(gate.dtype), dshift.to(shift_dtype), dscale.to(scale.dtype)
