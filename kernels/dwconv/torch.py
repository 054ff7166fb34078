"""Residual depthwise 3x3 conv on (B, N, C) tokens, the PyTorch path: ``act(x + dwconv3x3(x))``.

The aten ops the blocks run (a channels-last view of the tokens, ``F.conv2d`` with ``groups=C``, an add, GELU),
differentiated by autograd.  The layers keep their own copy of these ops for the PyTorch path (with their eager
shortcuts); this one serves the op registry (``verify``'s reference) and the custom op's non-Triton branch.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["residual_dwconv_torch", "residual_dwconv_bwd_torch", "check_residual_dwconv", "ACTS"]

ACTS = (None, "gelu")  # the activations the op fuses (exact GELU, nn.GELU's default)


def check_residual_dwconv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          feat_size: Tuple[int, int], act: Optional[str]) -> None:
    if x.dim() != 3:
        raise ValueError(f"residual_dwconv3x3 expects (B, N, C) tokens, got shape {tuple(x.shape)}")
    c = x.shape[2]
    if tuple(weight.shape) != (c, 1, 3, 3) or (bias is not None and tuple(bias.shape) != (c,)):
        raise ValueError(f"residual_dwconv3x3 expects a depthwise weight ({c}, 1, 3, 3) and bias ({c},), got "
                         f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    if len(feat_size) != 2 or feat_size[0] * feat_size[1] != x.shape[1]:
        raise ValueError(f"residual_dwconv3x3: feat_size {tuple(feat_size)} does not hold the {x.shape[1]} tokens")
    if act not in ACTS:
        raise ValueError(f"residual_dwconv3x3: act must be one of {ACTS}, got {act!r}")


def residual_dwconv_torch(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          feat_size: Tuple[int, int], act: Optional[str] = None) -> torch.Tensor:
    check_residual_dwconv(x, weight, bias, feat_size, act)
    b, n, c = x.shape
    fmap = x.unflatten(1, (feat_size[0], feat_size[1])).permute(0, 3, 1, 2)  # channels-last view, no copy
    conv = F.conv2d(fmap, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), padding=1, groups=c)
    y = x + conv.reshape(b, c, n).transpose(1, 2)
    return F.gelu(y) if act == "gelu" else y


def _gelu_grad(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(t * 0.7071067811865476)) + t * torch.exp(-0.5 * t * t) * 0.3989422804014327


def residual_dwconv_bwd_torch(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              feat_size: Tuple[int, int], act: Optional[str], pre_x: Optional[torch.Tensor] = None):
    """(dx, dweight, dbias) of :func:`residual_dwconv_torch` without autograd (the custom op's PyTorch branch runs
    below autograd): g' = dy act'(pre); dx = g' + conv(g', taps flipped); dW_ij = sum g' x(shift ij); db = sum g'.
    ``pre_x``: x = gelu(pre_x), and dx is the gradient of pre_x."""
    b, n, c = x.shape
    h, w = feat_size
    if act == "gelu":
        dy = dy * _gelu_grad(residual_dwconv_torch(x, weight, bias, feat_size, None))
    flipped = weight.flip(2, 3).to(dy.dtype)
    gmap = dy.unflatten(1, (h, w)).permute(0, 3, 1, 2)
    dx = dy + F.conv2d(gmap, flipped, padding=1, groups=c).reshape(b, c, n).transpose(1, 2)
    xpad = F.pad(x.unflatten(1, (h, w)), (0, 0, 1, 1, 1, 1))
    g = dy.unflatten(1, (h, w))
    dw = torch.stack([(g * xpad[:, i:i + h, j:j + w]).sum((0, 1, 2)) for i in range(3) for j in range(3)], 1)
    if pre_x is not None:  # x = gelu(pre_x): the gradient of pre_x
        dx = dx * _gelu_grad(pre_x)
    return dx.to(x.dtype), dw.reshape(c, 1, 3, 3).to(weight.dtype), dy.sum((0, 1)).to(weight.dtype)
