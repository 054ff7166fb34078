"""Helpers shared by the TTT-Linear reference (``naive.py``) and the fast paths (``torch.py``, ``ops.py``, the
linear-attention scan): the position factor inside a mini-batch, the one argument check of the scans (TTT-Linear and linear attention) and the stacking
of both scan directions on the batch axis.  All TorchScript-compilable."""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..rope import inner_rope
from ..utils import compute_dtype as _compute_dtype  # fp16/bf16: state and LN statistics in float32

__all__ = ["token_tau", "inner_rope", "check_scan_args", "check_bidir_state", "scan_setup", "bidir_inputs", "bidir_outputs"]


def token_tau(tau_offset: torch.Tensor) -> torch.Tensor:
    """Position factor inside a mini-batch: ``tau_i = max(0, 1/i + offset_i)``, i = 1..b."""
    b = tau_offset.shape[-1]
    pos = torch.arange(1, b + 1, device=tau_offset.device, dtype=tau_offset.dtype)
    return F.relu(1.0 / pos + tau_offset)


def check_scan_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                    w0: torch.Tensor, b0: torch.Tensor, mini_batch: int, state_per_sample: bool = False) -> None:
    """The one argument check of the scans (TTT-Linear and linear attention, every path): q, k, v (B, heads, N, d),
    lr (B, heads, N), tau (mini_batch,), w0 (S, heads, d, d) and b0 (S, heads, 1, d) with one leading S (1: shared;
    B or per direction: checked where the scan forms its directions, or here with ``state_per_sample``: 1 or B)."""
    if q.dim() != 4 or list(k.shape) != list(q.shape) or list(v.shape) != list(q.shape):
        raise ValueError(f"q, k, v must share a (B, heads, N, d) shape, got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    bsz, heads, n, d = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    if list(lr.shape) != [bsz, heads, n]:
        raise ValueError(f"lr must be (B, heads, N) = {[bsz, heads, n]}, got {list(lr.shape)}")
    if mini_batch < 1 or list(tau.shape) != [mini_batch]:
        raise ValueError(f"tau must have one entry per mini-batch position ({mini_batch}), got {list(tau.shape)}")
    if (w0.dim() != 4 or b0.dim() != 4 or list(w0.shape[1:]) != [heads, d, d] or list(b0.shape[1:]) != [heads, 1, d]
            or b0.shape[0] != w0.shape[0] or (state_per_sample and w0.shape[0] != 1 and w0.shape[0] != bsz)):
        lead = "1 or B" if state_per_sample else "S"
        raise ValueError(f"w0 must be ({lead}, {heads}, {d}, {d}) and b0 ({lead}, {heads}, 1, {d}) with the same "
                         f"leading dim; got {list(w0.shape)} and {list(b0.shape)}")


def check_bidir_state(w0: torch.Tensor, b0: torch.Tensor) -> None:
    """The initial state of a bidirectional scan: one shared by both directions (leading 1) or one per direction (2)."""
    if (w0.shape[0] != 1 and w0.shape[0] != 2) or b0.shape[0] != w0.shape[0]:
        raise ValueError(f"w0/b0 need a leading dim of 1 (shared) or 2 (per direction), got {list(w0.shape)}")


def scan_setup(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                w0: torch.Tensor, b0: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, mini_batch: int
                ) -> Tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks the scan's arguments; returns the compute dtype and, in it, ``ln_w``, ``ln_b`` as (1, heads, 1, d)
    and the initial state ``w0`` (B, heads, d, d), ``b0`` (B, heads, 1, d) expanded over the batch."""
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch)
    bsz, heads, d = q.shape[0], q.shape[1], q.shape[3]
    cd = _compute_dtype(q.dtype)
    return (cd, ln_w.to(cd).reshape(1, heads, 1, d), ln_b.to(cd).reshape(1, heads, 1, d),
            w0.to(cd).expand(bsz, heads, d, d), b0.to(cd).expand(bsz, heads, 1, d))


def _flip_both(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (2B, ...): the sequence (dim 2) and its reverse, stacked on the batch axis."""
    return torch.cat([x, x.flip(2)], dim=0)


def bidir_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, w0: torch.Tensor,
                 b0: torch.Tensor, mini_batch: int, rope_theta: Optional[float]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both scan directions stacked on the batch axis (2B), in-chunk RoPE applied, W0/b0 per direction."""
    bsz = q.shape[0]
    check_bidir_state(w0, b0)
    q2, v2 = _flip_both(q), _flip_both(v)
    if rope_theta is not None:
        q2 = inner_rope(q2, mini_batch, rope_theta)
    k2 = q2  # shared q = k: formed once (the scan then also skips the second projection)
    if k is not q:
        k2 = _flip_both(k)
        if rope_theta is not None:
            k2 = inner_rope(k2, mini_batch, rope_theta)
    if w0.shape[0] == 2:
        w0 = w0.repeat_interleave(bsz, dim=0)
        b0 = b0.repeat_interleave(bsz, dim=0)
    return q2, k2, v2, _flip_both(lr), w0, b0


def bidir_outputs(out: torch.Tensor, gn: Optional[torch.Tensor], bsz: int
                  ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum of the forward scan and the re-flipped backward scan; grad norms stacked (2, B, heads, N)."""
    out = out[:bsz] + out[bsz:].flip(2)
    if gn is not None:
        gn = torch.stack([gn[:bsz], gn[bsz:].flip(2)])
    return out, gn
