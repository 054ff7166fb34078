"""Helpers shared by the linear-attention reference (``naive.py``) and its PyTorch / Triton paths: the argument
check and the two-direction composition."""
from typing import Optional

import torch

from ..ttt_linear.common import bidir_inputs, bidir_outputs

__all__ = ["check_la_args", "la_bidir"]


def check_la_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                  w0: torch.Tensor, b0: torch.Tensor, mini_batch: int) -> None:
    """Shapes of the scan's arguments (TorchScript-compilable)."""
    if q.dim() != 4 or list(k.shape) != list(q.shape) or list(v.shape) != list(q.shape):
        raise ValueError("q, k, v must share a (B, heads, N, d) shape, got " + str(list(q.shape)) + ", "
                         + str(list(k.shape)) + ", " + str(list(v.shape)))
    bsz, h, n, d = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    if list(lr.shape) != [bsz, h, n]:
        raise ValueError("lr must be (B, heads, N) = " + str([bsz, h, n]) + ", got " + str(list(lr.shape)))
    if mini_batch < 1 or list(tau.shape) != [mini_batch]:
        raise ValueError("tau must have one entry per mini-batch position (" + str(mini_batch) + "), got "
                         + str(list(tau.shape)))
    if (w0.dim() != 4 or list(w0.shape[1:]) != [h, d, d] or (w0.shape[0] != 1 and w0.shape[0] != bsz)
            or b0.dim() != 4 or list(b0.shape[1:]) != [h, 1, d] or b0.shape[0] != w0.shape[0]):
        raise ValueError("w0 must be (1 or B, heads, d, d) and b0 (1 or B, heads, 1, d) with (heads, d) = "
                         + str([h, d]) + "; got " + str(list(w0.shape)) + " and " + str(list(b0.shape)))


def la_bidir(scan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
             w0: torch.Tensor, b0: torch.Tensor, mini_batch: int = 16, rope_theta: Optional[float] = 10000.0
             ) -> torch.Tensor:
    """Forward scan + scan of the flipped sequence, summed (Vision-TTT Eq. 12), with the single-direction ``scan``;
    both directions stacked on the batch axis, each forming its mini-batches (and in-chunk RoPE) in its own order.
    ``w0``/``b0``: (1 | 2, heads, ...), one state shared by both directions or one per direction."""
    q2, k2, v2, lr2, w0, b0 = bidir_inputs(q, k, v, lr, w0, b0, mini_batch, rope_theta)
    out, _ = bidir_outputs(scan(q2, k2, v2, lr2, tau, w0, b0, mini_batch), None, q.shape[0])
    return out
