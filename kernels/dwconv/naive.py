"""Plain residual depthwise 3x3 conv (the ``torch_naive`` backend and the float64 reference of the tests).

    y = act(x + b + sum_{i,j} w[:, 0, i, j] * x(h + i - 1, w + j - 1))   on (B, N = H W, C) channels-last tokens,

zero ('same') padding, ``act`` None or the exact (erf) GELU.  Nine shifted slices of the padded map, no conv op.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .torch import check_residual_dwconv

__all__ = ["residual_dwconv_reference"]


def residual_dwconv_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              feat_size: Tuple[int, int], act: Optional[str] = None) -> torch.Tensor:
    check_residual_dwconv(x, weight, bias, feat_size, act)
    b, n, c = x.shape
    h, w = feat_size
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    m = x.to(dt).reshape(b, h, w, c)
    padded = F.pad(m, (0, 0, 1, 1, 1, 1))
    taps = weight.to(dt).reshape(c, 9)
    y = m if bias is None else m + bias.to(dt)
    for i in range(3):
        for j in range(3):
            y = y + padded[:, i:i + h, j:j + w, :] * taps[:, 3 * i + j]
    if act == "gelu":
        y = 0.5 * y * (1.0 + torch.erf(y / math.sqrt(2.0)))
    return y.reshape(b, n, c).to(x.dtype)
