"""Helpers shared by the linear-attention reference (``naive.py``) and its PyTorch / Triton paths: the
two-direction composition (the argument check is the scans' one, ``ttt_linear.common.check_scan_args``)."""
from typing import Optional

import torch

from ..ttt_linear.common import bidir_inputs, bidir_outputs

__all__ = ["la_bidir"]


def la_bidir(scan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
             w0: torch.Tensor, b0: torch.Tensor, mini_batch: int = 16, rope_theta: Optional[float] = 10000.0
             ) -> torch.Tensor:
    """Forward scan + scan of the flipped sequence, summed (Vision-TTT Eq. 12), with the single-direction ``scan``;
    both directions stacked on the batch axis, each forming its mini-batches (and in-chunk RoPE) in its own order.
    ``w0``/``b0``: (1 | 2, heads, ...), one state shared by both directions or one per direction."""
    q2, k2, v2, lr2, w0, b0 = bidir_inputs(q, k, v, lr, w0, b0, mini_batch, rope_theta)
    out, _ = bidir_outputs(scan(q2, k2, v2, lr2, tau, w0, b0, mini_batch), None, q.shape[0])
    return out
