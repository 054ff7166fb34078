"""Chunk-parallel form of the linear-attention Vision-TTT scan (the ``torch`` backend), exact to the recurrent
form of ``naive.py`` (same terms, summed in another order; float64 agrees to ~1e-14).

With chunks = mini-batches (the sequence zero-padded to whole chunks, padded tokens have lr = 0), ``q~ = [q, 1]``,
``k~ = [k, 1]``, ``u_j = lr_j v_j``:

    U_c = tau_{b-1} k~_c^T u_c                       per-chunk state increment, all chunks at once
    S_c = [W0; b0] + sum_{c' < c} U_c'               exclusive prefix sum over chunks (no loop)
    O_c = q~_c S_c + (tril(tau_i) * (q~_c k~_c^T)) u_c   (inclusive in-chunk mask)

A shorter last mini-batch uses ``tau[:r]``: its rows are the first r of a padded chunk and its state is never
carried on, so padding is exact.  Memory per (batch, head): the chunk states, ceil(N / b) x (d + 1) x d
(the chunked linear-attention form); autograd differentiates it (every step is a batched GEMM or a cumsum).
"""
import torch
import torch.nn.functional as F

from ..utils import compute_dtype, no_autocast
from ..ttt_linear.common import check_scan_args

__all__ = ["la_chunk_torch"]


def _pad_chunks(x: torch.Tensor, n_pad: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, n_pad)) if x.dim() == 4 else F.pad(x, (0, n_pad))


def la_chunk_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                   w0: torch.Tensor, b0: torch.Tensor, mini_batch: int = 16) -> torch.Tensor:
    """Same arguments and result as ``naive.la_scan_naive``; no loop over the mini-batches.  Computed in float32
    (float64 for float64 inputs) whatever the autocast state, as the Triton path."""
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch, state_per_sample=True)
    with no_autocast(q.device):
        return _la_chunk(q, k, v, lr, tau, w0, b0, mini_batch)


def _la_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
              w0: torch.Tensor, b0: torch.Tensor, mini_batch: int) -> torch.Tensor:
    out_dtype = q.dtype
    cd = compute_dtype(q.dtype)
    bsz, h, n, d = q.shape
    c = mini_batch
    nc = (n + c - 1) // c  # not -(-n // c): ONNX integer Div truncates, so an exported graph got 0 chunks
    pad = nc * c - n
    shared = q is k
    q, k, v, lr = (_pad_chunks(t.to(cd), pad) for t in (q, k, v, lr))
    tau = tau.to(cd)
    one = torch.ones(bsz, h, nc * c, 1, device=q.device, dtype=cd)
    ka = torch.cat([k, one], -1).reshape(bsz, h, nc, c, d + 1)
    qa = ka if shared else torch.cat([q, one], -1).reshape(bsz, h, nc, c, d + 1)
    u = (v * lr[..., None]).reshape(bsz, h, nc, c, d)
    s0 = torch.cat([w0.to(cd), b0.to(cd)], 2)
    # exclusive prefix sum: the cumsum of the increments shifted by one chunk (no subtraction of large sums)
    inc = ka.transpose(-1, -2) @ u * tau[c - 1]
    states = s0.unsqueeze(2) + torch.cumsum(F.pad(inc[:, :, :-1], (0, 0, 0, 0, 1, 0)), dim=2)
    attn = (qa @ ka.transpose(-1, -2)) * torch.tril(tau[:, None].expand(c, c))
    out = qa @ states + attn @ u
    return out.reshape(bsz, h, nc * c, d)[:, :, :n].to(out_dtype)
