"""Export form of the TTT-Linear scan: what both of torch's ONNX exporters trace, with the token count symbolic.

Same math and signatures as ``naive.py`` (and ``chunked.py``, ``torch.py``); forward only, no autograd.Function,
no recomputation.  The sequence is zero-padded at its end to whole mini-batches with lr = 0: a padded token comes
after every real token of its mini-batch (the in-mini-batch mask is causal) and its step is scaled by lr = 0, and
the last mini-batch's state is never carried on, so no real output changes; the padded outputs are dropped.
Everything that does not depend on the state is formed for all mini-batches at once, then one loop over the
mini-batches carries the state ``S = [W; b]`` (:func:`_step`):

- torch.export (the dynamo exporter): ``torch.ops.higher_order.scan`` (ONNX ``Scan``);
- otherwise (torch.jit.trace, TorchScript's exporter; eager): a ``torch.jit.script``-ed loop, which a trace
  records as a loop (ONNX ``Loop``) whose trip count is the traced mini-batch count, not a constant.
"""
import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import bidir_inputs, bidir_outputs, scan_setup

__all__ = ["ttt_linear_export", "ttt_linear_bidir_export"]


def _normalize(z: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """LayerNorm without affine over the last dim, and 1 / std, in plain ops (TorchScript's exporter needs
    F.layer_norm's normalized shape constant; a traced head dim is not)."""
    zc = z - z.mean(-1, keepdim=True)
    rstd = torch.rsqrt(zc.pow(2).mean(-1, keepdim=True) + eps)
    return zc * rstd, rstd


def _ln_l2_grad(z: Tensor, c: Tensor, lnw2: Tensor, eps: float) -> Tensor:
    """d/dz of ``1/2 ||LN(z) * ln_w + ln_b - t||^2`` from ``c = (ln_b - t) * ln_w`` and ``lnw2 = ln_w^2``, in
    plain ops (``naive.ln_l2_grad`` rearranged)."""
    xh, rstd = _normalize(z, eps)
    gx = c + lnw2 * xh
    return (gx - gx.mean(-1, keepdim=True) - xh * (gx * xh).mean(-1, keepdim=True)) * rstd


def _step(state: Tensor, kc: Tensor, qc: Tensor, tgt: Tensor, kel: Tensor, attn: Tensor, lnw2: Optional[Tensor],
          eps: float) -> Tuple[Tensor, Tensor]:
    """One mini-batch from its incoming state (BH, d + 1, d): the outgoing state and z_bar (BH, c, d)."""
    z = torch.bmm(kc, state)
    g = z - tgt if lnw2 is None else _ln_l2_grad(z, tgt, lnw2, eps)
    z_bar = torch.baddbmm(torch.bmm(qc, state), attn, g)
    return torch.baddbmm(state, kel, g), z_bar


def _loop(state: Tensor, kc: Tensor, qc: Tensor, tgt: Tensor, kel: Tensor, attn: Tensor, lnw2: Optional[Tensor],
          eps: float) -> Tensor:
    """:func:`_step` over the mini-batches (leading axis of kc, ...): z_bar (n_mb, BH, c, d)."""
    outs: List[Tensor] = []
    for i in range(kc.shape[0]):
        state, z_bar = _step(state, kc[i], qc[i], tgt[i], kel[i], attn[i], lnw2, eps)
        outs.append(z_bar)
    return torch.stack(outs)


@functools.lru_cache(maxsize=None)
def _scripted_loop():
    return torch.jit.script(_loop)  # compiled on first use: importing the package stays cheap


def _run_loop(state: Tensor, xs: List[Tensor], lnw2: Optional[Tensor], eps: float) -> Tensor:
    if torch.compiler.is_exporting():
        from torch._higher_order_ops.scan import scan

        def combine(st: Tensor, x: List[Tensor]) -> Tuple[Tensor, Tensor]:
            return _step(st, x[0], x[1], x[2], x[3], x[4], lnw2, eps)
        return scan(combine, state, xs)[1]
    return _scripted_loop()(state, *xs, lnw2, eps)


def ttt_linear_export(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ln_w: Tensor,
                      ln_b: Tensor, mini_batch: int = 16, ln_residual: bool = True, eps: float = 1e-6,
                      return_grad_norm: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Causal scan, arguments and result as ``naive.ttt_linear_naive`` (no grad-norm map: an inference graph)."""
    if return_grad_norm:
        raise ValueError("the export form of the TTT-Linear scan has no grad-norm map; use ttt_linear_chunked")
    out_dtype = q.dtype
    cd, lnw, lnb, w, b = scan_setup(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch)
    bsz, heads, n, d = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    bh, c = bsz * heads, mini_batch
    nc = (n + c - 1) // c  # not -(-n // c): ONNX's integer Div truncates
    pad = nc * c - n
    q, k, v, lr, tau = q.to(cd), k.to(cd), v.to(cd), lr.to(cd), tau.to(cd)
    one = torch.ones_like(q[..., :1])
    qa, ka = torch.cat([q, one], -1), torch.cat([k, one], -1)
    tgt = (lnb - (v - k)) * lnw if ln_residual else v
    lnw2 = (lnw * lnw).expand(bsz, heads, 1, d).reshape(bh, 1, d) if ln_residual else None

    def chunks(t: Tensor) -> Tensor:  # (B, H, N, e) -> (n_mb, BH, c, e), padded
        return F.pad(t, (0, 0, 0, pad)).reshape(bh, nc, c, t.shape[-1]).transpose(0, 1)
    qc, kc = chunks(qa), chunks(ka)
    lrc = F.pad(lr, (0, pad)).reshape(bh, nc, 1, c).transpose(0, 1)  # (n_mb, BH, 1, c)
    causal = torch.tril(torch.ones(c, c, dtype=cd, device=q.device)) * -tau[:, None]
    attn = torch.matmul(qc, kc.transpose(-1, -2)) * (causal * lrc)  # -eta * (q k^T + 1), eta_ij = tau_i lr_j
    kel = (kc * (-tau[c - 1] * lrc).transpose(-1, -2)).transpose(-1, -2)  # -k_j eta_{c,j}: (n_mb, BH, d + 1, c)
    state = torch.cat([w, b], 2).reshape(bh, d + 1, d)
    z_bar = _run_loop(state, [kc, qc, chunks(tgt), kel, attn], lnw2, eps)
    z_bar = z_bar.transpose(0, 1).reshape(bsz, heads, nc * c, d)[:, :, :n]
    if not ln_residual:
        return z_bar.to(out_dtype), None
    return torch.addcmul(q + lnb, _normalize(z_bar, eps)[0], lnw).to(out_dtype), None


def ttt_linear_bidir_export(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                            ln_w: Tensor, ln_b: Tensor, mini_batch: int = 16, ln_residual: bool = True,
                            rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False
                            ) -> Tuple[Tensor, Optional[Tensor]]:
    """Both directions stacked on the batch axis, summed (as ``naive.ttt_linear_bidir_naive``)."""
    q2, k2, v2, lr2, w0, b0 = bidir_inputs(q, k, v, lr, w0, b0, mini_batch, rope_theta)
    out, _ = ttt_linear_export(q2, k2, v2, lr2, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps,
                               return_grad_norm)
    return bidir_outputs(out, None, q.shape[0])
