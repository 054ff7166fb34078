"""The TTT-Linear scan as ``torch.library`` custom ops (``ttt_zoo::ttt_linear_scan_fwd`` / ``_bwd``).

General contract of ``torch.py`` (``ndir`` = 1 causal, 2 bidirectional with direction 1 reversed).  The ops have
one kernel for every device: Triton when their last argument ``triton`` says so (the backend the caller chose once,
under its own op name: ``backend.resolve_backend``), the recomputing PyTorch path otherwise, plus fake (meta) implementations,
so ``torch.compile`` treats them as opaque nodes and meta-device models build and run.  The forward op is differentiable through ``register_autograd``.

    out, states = torch.ops.ttt_zoo.ttt_linear_scan_fwd(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch,
                                                         ln_residual, eps, save_states, triton)
    dq, dk, dv, dlr, dtau, dw0, db0, dln_w, dln_b = torch.ops.ttt_zoo.ttt_linear_scan_bwd(
        do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps, triton)

``ttt_linear_op`` / ``ttt_linear_bidir_op`` have the signatures of the references.  ``return_grad_norm=True`` (the
gradient-magnitude map, inference only) runs the PyTorch reference, not the kernels.
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..backend import tracing, triton_choice
from ..rope import rope_1d, rope_1d_tables
from ..utils import needs_grad as _needs_grad
from ..utils import cached_constant, count_flops_as, launches_kernel, triton_module
from . import torch as R
from .common import check_scan_args

__all__ = ["scan_fwd_op", "scan_bwd_op", "ttt_linear_op", "ttt_linear_bidir_op"]


def _t():
    return triton_module(__package__)



@torch.library.custom_op("ttt_zoo::ttt_linear_scan_fwd", mutates_args=())
def scan_fwd_op(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ln_w: Tensor,
                ln_b: Tensor, ndir: int, mini_batch: int, ln_residual: bool, eps: float,
                save_states: bool, triton: bool) -> Tuple[Tensor, Tensor]:
    impl = _t().scan_fwd_triton if launches_kernel(triton, q) else R.scan_fwd
    out, st = impl(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states)
    return out.contiguous(), st.contiguous()


@scan_fwd_op.register_fake
def _(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states, triton):
    _, bsz, h, n, d = q.shape
    cd = q.dtype if q.dtype == torch.float64 else torch.float32
    n_mb = -(-n // mini_batch)
    n_ck = -(-n_mb // R.ckpt_every(n_mb))
    st = q.new_empty(ndir * bsz, h, n_ck, d + 1, d, dtype=cd) if save_states else q.new_empty(0, dtype=cd)
    return q.new_empty(bsz, h, n, d), st


@torch.library.custom_op("ttt_zoo::ttt_linear_scan_bwd", mutates_args=())
def scan_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                ln_w: Tensor, ln_b: Tensor, states: Tensor, ndir: int, mini_batch: int, ln_residual: bool,
                eps: float, triton: bool) -> List[Tensor]:
    impl = _t().scan_bwd_triton if launches_kernel(triton, q) else R.scan_bwd
    grads = impl(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps)
    return [g.contiguous() for g in grads]


@scan_bwd_op.register_fake
def _(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps, triton):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, lr, tau, w0, b0, ln_w, ln_b)]


def _setup(ctx, inputs, output):
    q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states, triton = inputs
    ctx.save_for_backward(q, k, v, lr, tau, w0, b0, ln_w, ln_b, output[1])
    ctx.cfg = (ndir, mini_batch, ln_residual, eps, triton)


def _backward(ctx, dout, dstates):
    grads = scan_bwd_op(dout.contiguous(), *ctx.saved_tensors, *ctx.cfg)
    return (*grads, None, None, None, None, None, None)


scan_fwd_op.register_autograd(_backward, setup_context=_setup)
count_flops_as(scan_fwd_op, R.scan_fwd)
count_flops_as(scan_bwd_op, R.scan_bwd)


def _scan(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir: int, mini_batch: int, ln_residual: bool, eps: float,
          triton: bool) -> Tensor:
    save = _needs_grad(q, k, v, lr, tau, w0, b0, ln_w, ln_b)
    return scan_fwd_op(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, int(mini_batch), bool(ln_residual), float(eps),
                       save, bool(triton))[0]


def ttt_linear_op(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                  eps: float = 1e-6, return_grad_norm: bool = False, triton=None) -> Tuple[Tensor, Optional[Tensor]]:
    """Causal scan through the custom ops (the ``triton`` backend; ``triton=False``: their PyTorch path, the opaque
    node torch.compile sees for the ``torch`` backend; None: as ``backend.triton_choice``); signature of
    ``naive.ttt_linear_naive``."""
    if return_grad_norm:  # the map is the torch backend's (the chunked forward)
        return R.ttt_linear_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps, True)
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch)
    q1, k1, w1, b1 = R.single_inputs(q, k, w0, b0)
    triton = triton_choice(q, "ttt_linear", q.shape[-1]) if triton is None else bool(triton)
    return _scan(q1, k1, v, lr, tau, w1, b1, ln_w, ln_b, 1, mini_batch, ln_residual, eps, triton), None


# eager-only cache of the bidirectional in-chunk RoPE tables (2, N, d/2) (utils.cached_constant); plain tensors,
# never modified
_ROPE_TABLES: Dict[Tuple[int, int, int, float, str, torch.dtype], Tuple[Tensor, Tensor]] = {}


def _bidir_rope_tables(n: int, mini_batch: int, d: int, theta: float, device: torch.device, dtype: torch.dtype
                       ) -> Tuple[Tensor, Tensor]:
    pf, pb = R._bidir_positions(n, mini_batch, device)
    cos, sin = rope_1d_tables(torch.cat([pf, pb]), d, theta, dtype)
    return cos.view(2, 1, 1, n, d // 2), sin.view(2, 1, 1, n, d // 2)


def _cached_bidir_rope(n: int, mini_batch: int, d: int, theta: float, device: torch.device, dtype: torch.dtype
                       ) -> Tuple[Tensor, Tensor]:
    return cached_constant(_ROPE_TABLES, (n, mini_batch, d, float(theta), str(device), dtype),
                           lambda: _bidir_rope_tables(n, mini_batch, d, theta, device, dtype))


def _bidir_inputs(q: Tensor, k: Tensor, w0: Tensor, b0: Tensor, mini_batch: int, rope_theta: Optional[float]
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``torch.bidir_inputs`` with the tables cached and both directions rotated in one broadcast ``rope_1d`` (on the
    stacked q, k when they differ); tracing (TorchScript, FX, torch.compile, export) takes the reference form."""
    if (rope_theta is None or torch.jit.is_scripting() or tracing()
            or isinstance(q, torch.fx.Proxy)):
        return R.bidir_inputs(q, k, w0, b0, mini_batch, rope_theta)
    R.check_bidir_state(w0, b0)
    cos, sin = _cached_bidir_rope(q.shape[2], mini_batch, q.shape[-1], rope_theta, q.device, q.dtype)
    if k is q:
        q2 = rope_1d(q, cos, sin)  # (2, B, H, N, d)
        return q2, q2.view_as(q2), w0[:, None], b0[:, None]
    qk = rope_1d(torch.stack([q, k]).unsqueeze(1), cos.unsqueeze(0), sin.unsqueeze(0))  # (2 [q, k], 2, B, H, N, d)
    return qk[0], qk[1], w0[:, None], b0[:, None]


def ttt_linear_bidir_op(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                        rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False,
                        triton=None) -> Tuple[Tensor, Optional[Tensor]]:
    """Bidirectional scan, both directions in one kernel launch; signature of ``ttt_linear_bidir``.

    In-chunk RoPE runs in PyTorch before the op (one rotated q, k per direction, in original token order; in eager
    from cached tables).
    """
    if return_grad_norm:  # as above
        return R.ttt_linear_bidir_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, rope_theta,
                                        eps, True)
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch)
    q2, k2, w2, b2 = _bidir_inputs(q, k, w0, b0, mini_batch, rope_theta)
    triton = triton_choice(q, "ttt_linear_bidir", q.shape[-1]) if triton is None else bool(triton)
    return _scan(q2, k2, v, lr, tau, w2, b2, ln_w, ln_b, 2, mini_batch, ln_residual, eps, triton), None
