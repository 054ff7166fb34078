"""Plain key instance-norm (the ``torch_naive`` backend): (B, N, C) normalised over N per sample and channel."""
import torch

from .torch import stat_dtype

__all__ = ["key_norm_reference"]


def key_norm_reference(x: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    xf = x.to(stat_dtype(x.dtype))
    mean = xf.mean(dim=1, keepdim=True)
    var = xf.var(dim=1, unbiased=False, keepdim=True)
    return ((xf - mean) / torch.sqrt(var + eps)).to(x.dtype)
