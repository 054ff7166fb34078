"""Recurrent reference of the plain linear-attention Vision-TTT scan (the ``torch_naive`` backend).

TTT-Linear's mini-batch dual form (``ttt_linear/naive.py``) with the inner LayerNorm and residual removed and the
regression loss replaced by the dot product: per head the inner model is ``f(x) = x W + b`` and token j's loss is
``l_j = -<k_j W + b, v_j>``, so its gradient ``dl_j / df = -v_j`` does not depend on the state.  Mini-batches of
``mini_batch`` tokens; inside one every gradient is taken at the mini-batch's incoming state and token i reads
``W_i = W - sum_{j<=i} eta_ij k_j^T (-v_j)`` with ``eta_ij = tau_i lr_j`` -- the mask is **inclusive** (j = i
counts) -- and the state carried on is the last row's, ``eta_{c-1, j} = tau_{c-1} lr_j`` (a shorter last
mini-batch of r tokens uses ``tau[:r]``).  Written out:

    z_i = q_i W + b + sum_{j <= i, same mini-batch} tau_i lr_j (q_i . k_j + 1) v_j
    W  <- W + sum_j tau_{c-1} lr_j k_j^T v_j,   b <- b + sum_j tau_{c-1} lr_j v_j

which is linear attention with keys/queries ``[k, 1]`` / ``[q, 1]``, initial state ``[W; b]`` and a mask that is
``tau_i lr_j`` inside a mini-batch (j <= i) and ``tau_{c-1} lr_j`` towards earlier mini-batches: ``torch.py`` is its
exact chunk-parallel form.  A negative ``lr`` is gradient ascent.
"""
from typing import List, Optional

import torch

from ..ttt_linear.common import bidir_inputs, bidir_outputs, check_scan_args
from ..utils import compute_dtype

__all__ = ["la_scan_naive", "la_bidir_reference"]


def la_scan_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                  w0: torch.Tensor, b0: torch.Tensor, mini_batch: int = 16) -> torch.Tensor:
    """Causal scan, one mini-batch at a time (the recurrent form).

    Args:
        q, k, v: (B, heads, N, d) in scan order; lr: (B, heads, N) per-token learning rate;
        tau: (mini_batch,) position factor; w0: (1 or B, heads, d, d), b0: (1 or B, heads, 1, d) initial state.
    Returns:
        (B, heads, N, d) in q's dtype (fp16/bf16 computed in float32).
    """
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch, state_per_sample=True)
    out_dtype = q.dtype
    cd = compute_dtype(q.dtype)
    q, k, v, lr, tau, w, b = q.to(cd), k.to(cd), v.to(cd), lr.to(cd), tau.to(cd), w0.to(cd), b0.to(cd)
    n = q.shape[2]
    outs: List[torch.Tensor] = []
    for s in range(0, n, mini_batch):
        e = min(s + mini_batch, n)
        qc, kc, vc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]
        eta = torch.tril(tau[:e - s, None] * lr[:, :, None, s:e])  # eta_ij = tau_i lr_j, j <= i (inclusive)
        outs.append(qc @ w + b + (eta * (qc @ kc.transpose(-1, -2) + 1.0)) @ vc)
        step = eta[:, :, -1, :, None] * vc  # the last row carries the state on
        w = w + kc.transpose(-1, -2) @ step
        b = b + step.sum(-2, keepdim=True)
    return torch.cat(outs, dim=2).to(out_dtype)


def la_bidir_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                       w0: torch.Tensor, b0: torch.Tensor, mini_batch: int = 16,
                       rope_theta: Optional[float] = 10000.0) -> torch.Tensor:
    """``common.la_bidir`` with the recurrent scan (TorchScript-compilable)."""
    q2, k2, v2, lr2, w0, b0 = bidir_inputs(q, k, v, lr, w0, b0, mini_batch, rope_theta)
    out, _ = bidir_outputs(la_scan_naive(q2, k2, v2, lr2, tau, w0, b0, mini_batch), None, q.shape[0])
    return out
