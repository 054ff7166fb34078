"""The TTT-Linear scan as ``torch.library`` custom ops (``ttt_zoo::ttt_linear_scan_fwd`` / ``_bwd``).

General contract of ``recompute.py`` (``ndir`` = 1 causal, 2 bidirectional with direction 1 reversed).  The ops have
one kernel for every device: Triton on CUDA (when Triton imports, head dim <= MAX_D) and on the CPU under
``TRITON_INTERPRET=1``, the recomputing PyTorch path otherwise (and for float64), plus fake (meta) implementations,
so ``torch.compile`` treats them as opaque nodes and meta-device models build and run.  The forward op is differentiable through ``register_autograd``.

    out, states = torch.ops.ttt_zoo.ttt_linear_scan_fwd(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch,
                                                         ln_residual, eps, save_states)
    dq, dk, dv, dlr, dtau, dw0, db0, dln_w, dln_b = torch.ops.ttt_zoo.ttt_linear_scan_bwd(
        do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps)

``ttt_linear_op`` / ``ttt_linear_bidir_op`` have the signatures of the references.  ``return_grad_norm=True`` (the
gradient-magnitude map, inference only) runs the PyTorch reference, not the kernels.
"""
import importlib.util
import os
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import recompute as R
from .reference import ttt_linear_reference

HAS_TRITON = importlib.util.find_spec("triton") is not None

__all__ = ["HAS_TRITON", "MAX_D", "scan_fwd_op", "scan_bwd_op", "ttt_linear_op", "ttt_linear_bidir_op"]


def _t():
    from . import triton as T  # lazy: CPU users never import Triton; tests set TRITON_INTERPRET first
    return T


MAX_D = 64  # on a GPU, head dims above this run the PyTorch path (two 128-padded d x d fp32 states per program
#             would spill registers; the ViT3 kernels' 128-padded variant did not compile in 150 s on an H100)


def _triton_ok(q: Tensor) -> bool:
    """CUDA (head dim <= MAX_D), or CPU under ``TRITON_INTERPRET=1`` (how the tests run the kernels, any head dim);
    float64 stays on PyTorch."""
    if not HAS_TRITON or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if q.device.type == "cuda":
        return q.shape[-1] <= MAX_D
    return q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@torch.library.custom_op("ttt_zoo::ttt_linear_scan_fwd", mutates_args=())
def scan_fwd_op(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ln_w: Tensor,
                ln_b: Tensor, ndir: int, mini_batch: int, ln_residual: bool, eps: float,
                save_states: bool) -> Tuple[Tensor, Tensor]:
    impl = _t().scan_fwd_triton if _triton_ok(q) else R.scan_fwd
    out, st = impl(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states)
    return out.contiguous(), st.contiguous()


@scan_fwd_op.register_fake
def _(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states):
    _, bsz, h, n, d = q.shape
    cd = q.dtype if q.dtype == torch.float64 else torch.float32
    n_mb = -(-n // mini_batch)
    n_ck = -(-n_mb // R.ckpt_every(n_mb))
    st = q.new_empty(ndir * bsz, h, n_ck, d + 1, d, dtype=cd) if save_states else q.new_empty(0, dtype=cd)
    return q.new_empty(bsz, h, n, d), st


@torch.library.custom_op("ttt_zoo::ttt_linear_scan_bwd", mutates_args=())
def scan_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                ln_w: Tensor, ln_b: Tensor, states: Tensor, ndir: int, mini_batch: int, ln_residual: bool,
                eps: float) -> List[Tensor]:
    impl = _t().scan_bwd_triton if _triton_ok(q) else R.scan_bwd
    grads = impl(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps)
    return [g.contiguous() for g in grads]


@scan_bwd_op.register_fake
def _(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, lr, tau, w0, b0, ln_w, ln_b)]


def _setup(ctx, inputs, output):
    q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states = inputs
    ctx.save_for_backward(q, k, v, lr, tau, w0, b0, ln_w, ln_b, output[1])
    ctx.cfg = (ndir, mini_batch, ln_residual, eps)


def _backward(ctx, dout, dstates):
    grads = scan_bwd_op(dout.contiguous(), *ctx.saved_tensors, *ctx.cfg)
    return (*grads, None, None, None, None, None)


scan_fwd_op.register_autograd(_backward, setup_context=_setup)


def _needs_grad(*ts: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _scan(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir: int, mini_batch: int, ln_residual: bool, eps: float) -> Tensor:
    save = _needs_grad(q, k, v, lr, tau, w0, b0, ln_w, ln_b)
    return scan_fwd_op(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, int(mini_batch), bool(ln_residual), float(eps),
                       save)[0]


def ttt_linear_op(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                  eps: float = 1e-6, return_grad_norm: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Causal scan through the custom ops (Triton on CUDA); signature of ``ttt_linear_reference``."""
    if return_grad_norm:
        return ttt_linear_reference(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, eps, True)
    R._check(q, k, v, lr, tau, w0, b0, mini_batch)
    q1, k1, w1, b1 = R.single_inputs(q, k, w0, b0)
    return _scan(q1, k1, v, lr, tau, w1, b1, ln_w, ln_b, 1, mini_batch, ln_residual, eps), None


def ttt_linear_bidir_op(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                        rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False
                        ) -> Tuple[Tensor, Optional[Tensor]]:
    """Bidirectional scan, both directions in one kernel launch; signature of ``ttt_linear_bidir``.

    In-chunk RoPE runs in PyTorch before the op (one rotated q, k per direction, in original token order).
    """
    if return_grad_norm:
        return R.ttt_linear_bidir_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, rope_theta,
                                        eps, True)
    R._check(q, k, v, lr, tau, w0, b0, mini_batch)
    q2, k2, w2, b2 = R.bidir_inputs(q, k, w0, b0, mini_batch, rope_theta)
    return _scan(q2, k2, v, lr, tau, w2, b2, ln_w, ln_b, 2, mini_batch, ln_residual, eps), None
