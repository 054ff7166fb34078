"""Triton forward of the linear-attention Vision-TTT scan (the ``triton`` backend).

One program per (batch x direction, head) walks the mini-batches with the state ``[W; b]`` in registers (fp32):
per mini-batch it loads q, k, v (b x d) and lr once, forms the inclusive in-chunk mask ``tau_i lr_j (q_i.k_j + 1)``
(j <= i), writes ``out = q W + b + mask v`` and adds ``k^T (tau_{b-1} lr * v)`` to the state.  Nothing of size
N x d x d reaches memory; extra memory per (batch, head): none.  The backward (``ops.py``) recomputes the
chunk-parallel form of ``torch.py`` and differentiates it.  Loads upcast to fp32; ``tl.dot`` in IEEE fp32 for fp32
inputs, TF32 for fp16/bf16; the output is stored in the input dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import block_d, jit_sizes, load_tile, pid64, prec, store_tile
from ..ttt_linear.common import check_scan_args

__all__ = ["la_fwd_triton"]


@jit_sizes(also=("slb", "slh"))  # lr is (B, heads, N): its strides follow N
def _la_fwd(Q, K, V, LR, TAU, W0, B0, O,
            sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, slb, slh, sln,
            swb, swh, swr, swc, sbb, sbh, sbd, sob, soh, son, sod,
            H, N, D, MB,
            BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    pid = pid64(0)
    b, h = pid // H, pid % H
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    dm = offs_d < D
    w = tl.load(W0 + b * swb + h * swh + offs_d[:, None] * swr + offs_d[None, :] * swc,
                mask=dm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    bias = tl.load(B0 + b * sbb + h * sbh + offs_d * sbd, mask=dm, other=0.0).to(tl.float32)
    in_mb = offs_c < MB
    tau = tl.load(TAU + offs_c, mask=in_mb, other=0.0).to(tl.float32)
    tau_last = tl.load(TAU + MB - 1).to(tl.float32)
    causal = offs_c[:, None] >= offs_c[None, :]
    for start in range(0, N, MB):
        offs_n = start + offs_c
        rows = in_mb & (offs_n < N)
        n_max = tl.minimum(N, start + MB)
        q = load_tile(Q, b * sqb + h * sqh, offs_n, offs_d, sqn, sqd, n_max, D)
        k = load_tile(K, b * skb + h * skh, offs_n, offs_d, skn, skd, n_max, D)
        v = load_tile(V, b * svb + h * svh, offs_n, offs_d, svn, svd, n_max, D)
        lr = tl.load(LR + b * slb + h * slh + offs_n * sln, mask=rows, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) + 1.0
        a = tl.where(causal, s * tau[:, None] * lr[None, :], 0.0)
        out = tl.dot(q, w, input_precision=PREC) + bias[None, :] + tl.dot(a, v, input_precision=PREC)
        store_tile(O, b * sob + h * soh, out, offs_n, offs_d, son, sod, n_max, D)
        u = v * (lr * tau_last)[:, None]
        w += tl.dot(tl.trans(k), u, input_precision=PREC)
        bias += tl.sum(u, 0)


def la_fwd_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                  w0: torch.Tensor, b0: torch.Tensor, mini_batch: int = 16) -> torch.Tensor:
    """Same arguments and result as ``naive.la_scan_naive`` (forward only)."""
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch, state_per_sample=True)
    bsz, h, n, d = q.shape
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    sw = (0 if w0.shape[0] == 1 else w0.stride(0), *w0.stride()[1:])
    sb = (0 if b0.shape[0] == 1 else b0.stride(0), b0.stride(1), b0.stride(3))
    _la_fwd[(bsz * h,)](q, k, v, lr, tau.contiguous(), w0, b0, out, *q.stride(), *k.stride(), *v.stride(),
                        *lr.stride(), *sw, *sb, *out.stride(), h, n, d, mini_batch,
                        BLOCK_C=max(16, triton.next_power_of_2(mini_batch)), BLOCK_D=block_d(d), PREC=prec(q.dtype),
                        num_warps=4 if block_d(d) <= 32 else 8)
    return out
