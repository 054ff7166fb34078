"""The TTT-Linear scan as ``torch.library`` custom ops (``ttt_zoo::ttt_linear_scan_fwd`` / ``_bwd``).

General contract of ``torch.py`` (``ndir`` = 1 causal, 2 bidirectional with direction 1 reversed).  The ops have
one kernel for every device: Triton when their last argument ``triton`` says so (the backend the caller chose once,
under its own op name: ``backend.resolve_backend``), the recomputing PyTorch path otherwise, plus fake (meta) implementations,
so ``torch.compile`` treats them as opaque nodes and meta-device models build and run.  The forward op is differentiable through ``register_autograd``.

    out, states = torch.ops.ttt_zoo.ttt_linear_scan_fwd(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch,
                                                         ln_residual, eps, save_states, triton, rope_theta,
                                                         lr_scale, tau_offset, dot_loss)
    dq, dk, dv, dlr, dtau, dw0, db0, dln_w, dln_b = torch.ops.ttt_zoo.ttt_linear_scan_bwd(
        do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps, triton, rope_theta,
        lr_scale, tau_offset, dot_loss, shared_qk)

``rope_theta`` > 0: the in-mini-batch RoPE (position ``p mod b`` of scan position p, in each direction) turns q and k
inside the op (the Triton kernels on load, with the inverse turn of dq, dk in their backward; the PyTorch path
before and after ``torch.py``), so q, k come unrotated, (1 | ndir, B, H, N, d); 0: q, k are used as given.
``lr_scale`` != 0: ``lr`` holds the rates' logits and the rate is ``lr_scale * sigmoid(lr)`` (the kernels form it on
load and return d/d logit); 0: ``lr`` is the rate.  ``tau_offset``: ``tau`` holds the offsets of
``common.token_tau`` and the factor is ``max(0, 1 / i + offset_i)`` (the kernels form it and return d/d offset).
``out`` is (B, H, N, d) with token-major strides (memory (B, N, H, d): ``out.transpose(1, 2)`` is the (B, N, C) map
without a copy); the kernels read ``do`` with its strides.  ``dot_loss``: the inner loss ``-<k W + b, v>`` (no inner
LayerNorm; ``ttt_linear_bidir_op``).  ``shared_qk`` (the forward was given one tensor as q and k): dq holds dq + dk
and dk is empty, so autograd adds nothing after the op.

``ttt_linear_op`` / ``ttt_linear_bidir_op`` have the signatures of the references.  ``return_grad_norm=True`` (the
gradient-magnitude map, inference only) runs the PyTorch reference, not the kernels.
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..backend import get_op, triton_choice
from ..rope import rope_1d, rope_1d_tables
from ..utils import needs_grad as _needs_grad
from ..utils import cached_constant, count_flops_as, launches_kernel, triton_module
from . import torch as R
from .common import check_scan_args, token_tau

__all__ = ["scan_fwd_op", "scan_bwd_op", "ttt_linear_op", "ttt_linear_bidir_op"]


def _t():
    return triton_module(__package__)



# eager cache of the in-mini-batch RoPE table of the kernels, (2 [cos, sin], b, d / 2) fp32 (utils.cached_constant)
_ROPE_TABLES: Dict[Tuple[int, int, float, str], Tensor] = {}


def _kernel_rope_table(mini_batch: int, d: int, theta: float, device: torch.device) -> Optional[Tensor]:
    if theta <= 0:
        return None

    def build():
        pos = torch.arange(mini_batch, device=device, dtype=torch.float64)
        return torch.stack(rope_1d_tables(pos, d, theta, torch.float32))
    return cached_constant(_ROPE_TABLES, (mini_batch, d, float(theta), str(device)), build)


def _direction_tables(x: Tensor, ndir: int, mini_batch: int, theta: float) -> List[Tuple[Tensor, Tensor]]:
    """cos, sin in ``x``'s dtype at every token's in-mini-batch position, per direction (``torch._bidir_positions``)."""
    pos = R._bidir_positions(x.shape[-2], mini_batch, x.device)[:ndir]
    return [rope_1d_tables(p, x.shape[-1], theta, x.dtype) for p in pos]


def _turned(x: Tensor, tables: List[Tuple[Tensor, Tensor]]) -> Tensor:
    """(1 | ndir, B, H, N, d) -> (ndir, B, H, N, d), direction r turned by its tables (the PyTorch path)."""
    return torch.stack([rope_1d(x[min(r, x.shape[0] - 1)], c, s) for r, (c, s) in enumerate(tables)])


def _unturned(dx: Tensor, like: Tensor, tables: List[Tuple[Tensor, Tensor]]) -> Tensor:
    """The backward of :func:`_turned`: each direction turned back (-sin), summed to ``like``'s leading dim."""
    dx = torch.stack([rope_1d(dx[r], c, -s) for r, (c, s) in enumerate(tables)])
    return dx.sum(0, keepdim=True) if like.shape[0] == 1 else dx


def _rates(lr: Tensor, tau: Tensor, lr_scale: float, tau_offset: bool) -> Tuple[Tensor, Tensor]:
    """The rates and position factors from logits and offsets (the PyTorch path of ``lr_scale``, ``tau_offset``)."""
    if lr_scale != 0:
        lr = lr_scale * torch.sigmoid(lr)
    return lr, (token_tau(tau) if tau_offset else tau)


@torch.library.custom_op("ttt_zoo::ttt_linear_scan_fwd", mutates_args=())
def scan_fwd_op(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ln_w: Tensor,
                ln_b: Tensor, ndir: int, mini_batch: int, ln_residual: bool, eps: float,
                save_states: bool, triton: bool, rope_theta: float = 0.0, lr_scale: float = 0.0,
                tau_offset: bool = False, dot_loss: bool = False) -> Tuple[Tensor, Tensor]:
    if not launches_kernel(triton, q):
        if dot_loss:
            out = _dot_scan(q, k, v, lr, tau, w0, b0, ndir, mini_batch, rope_theta, lr_scale, tau_offset)
            return _token_major(out), _fake_states(q, ndir, mini_batch, save_states)
        lr, tau = _rates(lr, tau, lr_scale, tau_offset)
    args = (v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states)
    if launches_kernel(triton, q):
        table = _kernel_rope_table(mini_batch, q.shape[-1], rope_theta, q.device)
        out, st = _t().scan_fwd_triton(q, k, *args, table, lr_scale, tau_offset, dot_loss)
    else:
        if rope_theta > 0:
            tables = _direction_tables(q, ndir, mini_batch, rope_theta)
            q2 = _turned(q, tables)
            q, k = q2, (q2 if k is q else _turned(k, tables))
        out, st = R.scan_fwd(q, k, *args)
        out = _token_major(out)  # the kernels' layout
    return out, st.contiguous()


def _fake_states(q: Tensor, ndir: int, mini_batch: int, save_states: bool) -> Tensor:
    """The saved chunk-start states' buffer, unfilled: (ndir B, H, n_ck, d + 1, d), or empty."""
    _, bsz, h, n, d = q.shape
    cd = q.dtype if q.dtype == torch.float64 else torch.float32
    n_mb = -(-n // mini_batch)
    n_ck = -(-n_mb // R.ckpt_every(n_mb))
    return q.new_empty(ndir * bsz, h, n_ck, d + 1, d, dtype=cd) if save_states else q.new_empty(0, dtype=cd)


@scan_fwd_op.register_fake
def _(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states, triton, rope_theta=0.0,
      lr_scale=0.0, tau_offset=False, dot_loss=False):
    _, bsz, h, n, d = q.shape
    st = _fake_states(q, ndir, mini_batch, save_states)
    return q.new_empty(bsz, n, h, d).transpose(1, 2), st  # token-major: (B, N, H * d) for the caller


def _dot_scan(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor, ndir: int,
              mini_batch: int, rope_theta: float, lr_scale: float, tau_offset: bool) -> Tensor:
    """The dot loss off the kernels (differentiable): each direction as linear attention's chunk form
    (the ``torch`` path of the ``linear_attention`` op, ``linear_attention.torch.la_chunk_torch``) in its scan order,
    summed; (B, H, N, d).  Taken from the op registry: ``linear_attention`` builds on this folder, not the reverse."""
    la_chunk_torch = get_op("linear_attention", q.device, "torch")
    lr, tau = _rates(lr, tau, lr_scale, tau_offset)
    if rope_theta > 0:
        tables = _direction_tables(q, ndir, mini_batch, rope_theta)
        q2 = _turned(q, tables)
        q, k = q2, (q2 if k is q else _turned(k, tables))
    out = None
    for r in range(ndir):
        def order(x: Tensor, dim: int = -2) -> Tensor:
            return x.flip(dim) if r else x
        o = order(la_chunk_torch(order(q[min(r, q.shape[0] - 1)]), order(k[min(r, k.shape[0] - 1)]), order(v),
                                 order(lr, -1), tau, w0[min(r, w0.shape[0] - 1)], b0[min(r, b0.shape[0] - 1)],
                                 mini_batch))
        out = o if out is None else out + o
    return out


def _dot_scan_vjp(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                  *cfg) -> List[Tensor]:
    """Gradients of :func:`_dot_scan` w.r.t. q, k, v, lr, tau, w0, b0 (recomputed under autograd)."""
    ins = [t.detach().requires_grad_(True) for t in (q, k, v, lr, tau, w0, b0)]
    with torch.enable_grad():
        grads = torch.autograd.grad(_dot_scan(*ins, *cfg), ins, do, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, ins)]


def _dot_grads(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, *cfg) -> List[Tensor]:
    """``scan_bwd_op``'s gradients of the dot loss off the kernels (no inner LayerNorm: its gradients are 0)."""
    grads = _dot_scan_vjp(do, q, k, v, lr, tau, w0, b0, *cfg)
    return _grad_layouts([_token_major(g) for g in grads[:3]] + grads[3:] +
                         [torch.zeros_like(ln_w), torch.zeros_like(ln_b)])


def _token_major(x: Tensor) -> Tensor:
    """(..., H, N, d) with (..., N, H, d) memory: the layout of the output and of dq, dk, dv (the projection's)."""
    return x.transpose(-3, -2).contiguous().transpose(-3, -2)


def _grad_layouts(grads: List[Tensor]) -> List[Tensor]:
    """dq, dk, dv token-major as they come, the rest contiguous."""
    return list(grads[:3]) + [g.contiguous() for g in grads[3:]]


@torch.library.custom_op("ttt_zoo::ttt_linear_scan_bwd", mutates_args=())
def scan_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                ln_w: Tensor, ln_b: Tensor, states: Tensor, ndir: int, mini_batch: int, ln_residual: bool,
                eps: float, triton: bool, rope_theta: float = 0.0, lr_scale: float = 0.0,
                tau_offset: bool = False, dot_loss: bool = False, shared_qk: bool = False) -> List[Tensor]:
    grads = _scan_bwd(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps, triton,
                      rope_theta, lr_scale, tau_offset, dot_loss, shared_qk)
    if shared_qk and grads[1].numel():  # the PyTorch paths: dq + dk into dq (the kernels write it so)
        grads[0], grads[1] = _token_major(grads[0] + grads[1]), k.new_empty(0)
    return grads


def _scan_bwd(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps, triton,
              rope_theta, lr_scale, tau_offset, dot_loss, shared_qk) -> List[Tensor]:
    logits = lr
    kernels = launches_kernel(triton, q)
    if dot_loss and not kernels:  # autograd of the chunk form: runs above the dispatcher (_backward, FLOP count)
        return _dot_grads(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, rope_theta, lr_scale, tau_offset)
    if not kernels:
        lr, tau = _rates(logits, tau, lr_scale, tau_offset)
    args = (v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps)
    if kernels:
        table = _kernel_rope_table(mini_batch, q.shape[-1], rope_theta, q.device)
        return _grad_layouts(_t().scan_bwd_triton(do, q, k, *args, table, lr_scale, tau_offset, dot_loss,
                                                  shared_qk))
    if rope_theta > 0:
        tables = _direction_tables(q, ndir, mini_batch, rope_theta)
        grads = R.scan_bwd(do.contiguous(), _turned(q, tables), _turned(k, tables), *args)
        grads[0], grads[1] = _unturned(grads[0], q, tables), _unturned(grads[1], k, tables)
    else:
        grads = R.scan_bwd(do.contiguous(), q, k, *args)
    if lr_scale != 0:  # the rate's sigmoid backward
        grads[3] = grads[3] * lr * (1 - torch.sigmoid(logits))
    if tau_offset:  # max(0, .)'s backward
        grads[4] = grads[4] * (tau > 0)
    return _grad_layouts([_token_major(g) for g in grads[:3]] + list(grads[3:]))


@scan_bwd_op.register_fake
def _(do, q, k, v, lr, tau, w0, b0, ln_w, ln_b, states, ndir, mini_batch, ln_residual, eps, triton, rope_theta=0.0,
      lr_scale=0.0, tau_offset=False, dot_loss=False, shared_qk=False):
    grads = [_token_major(torch.empty_like(t, memory_format=torch.contiguous_format)) for t in (q, k, v)] + \
        [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (lr, tau, w0, b0, ln_w, ln_b)]
    if shared_qk:
        grads[1] = k.new_empty(0)
    return grads


def _setup(ctx, inputs, output):
    q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, ln_residual, eps, save_states, triton, rope_theta, lr_scale, \
        tau_offset, dot_loss = inputs
    ctx.save_for_backward(q, k, v, lr, tau, w0, b0, ln_w, ln_b, output[1])
    ctx.cfg = (ndir, mini_batch, ln_residual, eps, triton, rope_theta, lr_scale, tau_offset, dot_loss)
    ctx.shared_qk = q is k  # one tensor for both: its gradient dq + dk comes summed (no add after the op)
    ctx.set_materialize_grads(False)  # the states are never differentiated: no zero cotangent is made for them


def _backward(ctx, dout, dstates):
    if dout is None:
        return (None,) * 19
    q, k, v, lr, tau, w0, b0, ln_w, ln_b, _ = ctx.saved_tensors
    ndir, mini_batch, _, _, triton, rope_theta, lr_scale, tau_offset, dot_loss = ctx.cfg
    if dot_loss and not launches_kernel(triton, q):  # autograd of the chunk form, here above the dispatcher
        grads = _dot_grads(dout, q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, mini_batch, rope_theta, lr_scale,
                           tau_offset)
    else:  # the kernels read dout with its strides
        grads = scan_bwd_op(dout, *ctx.saved_tensors, *ctx.cfg, ctx.shared_qk)
        if ctx.shared_qk:
            grads[1] = None
    return (*grads, None, None, None, None, None, None, None, None, None, None)


scan_fwd_op.register_autograd(_backward, setup_context=_setup)
count_flops_as(scan_fwd_op)  # the op's own PyTorch path: RoPE and rates as the kernels take them
count_flops_as(scan_bwd_op)


def _scan(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir: int, mini_batch: int, ln_residual: bool, eps: float,
          triton: bool, rope_theta: float = 0.0, lr_scale: float = 0.0, tau_offset: bool = False,
          dot_loss: bool = False) -> Tensor:
    save = _needs_grad(q, k, v, lr, tau, w0, b0, ln_w, ln_b)
    return scan_fwd_op(q, k, v, lr, tau, w0, b0, ln_w, ln_b, ndir, int(mini_batch), bool(ln_residual), float(eps),
                       save, bool(triton), float(rope_theta), float(lr_scale), bool(tau_offset), bool(dot_loss))[0]


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


def ttt_linear_bidir_op(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch: int = 16, ln_residual: bool = True,
                        rope_theta: Optional[float] = 10000.0, eps: float = 1e-6, return_grad_norm: bool = False,
                        triton=None, lr_scale: float = 0.0, tau_offset: bool = False, dot_loss: bool = False
                        ) -> Tuple[Tensor, Optional[Tensor]]:
    """Bidirectional scan, both directions in one kernel launch; signature of ``ttt_linear_bidir``.

    ``dot_loss``: the inner loss ``-<k W + b, v>`` (``linear_attention.naive``: G = -v, the raw prediction out, no
    inner LayerNorm: ``ln_w``, ``ln_b`` may be None and ``ln_residual`` is ignored); off the kernels its PyTorch
    path is linear attention's chunk form.

    ``lr_scale`` != 0: ``lr`` holds logits, the rate is ``lr_scale * sigmoid(lr)``, formed inside the op (the ops'
    ``lr_scale``); ``tau_offset``: ``tau`` holds ``token_tau``'s offsets (the ops' ``tau_offset``).  The in-chunk RoPE runs inside the op (``rope_theta`` of the ops): q, k go in unrotated, with a broadcast leading
    axis of 1 for both directions.
    """
    if dot_loss:
        if return_grad_norm:
            raise ValueError("return_grad_norm is defined for the MSE inner loss only")
        ln_residual = False
        ln_w, ln_b = _no_inner_norm(q)
    if return_grad_norm:  # as above
        lr, tau = _rates(lr, tau, lr_scale, tau_offset)
        return R.ttt_linear_bidir_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, rope_theta,
                                        eps, True)
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch)
    R.check_bidir_state(w0, b0)
    triton = triton_choice(q, "ttt_linear_bidir", q.shape[-1]) if triton is None else bool(triton)
    theta = 0.0 if rope_theta is None else float(rope_theta)
    if theta <= 0 and rope_theta is not None:
        raise ValueError(f"rope_theta must be > 0 (or None: no RoPE), got {rope_theta}")
    q1 = q[None]
    k1 = q1 if k is q else k[None]  # a shared q = k stays one tensor: the op's backward returns dq + dk at once
    return _scan(q1, k1, v, lr, tau, w0[:, None], b0[:, None], ln_w, ln_b, 2, mini_batch, ln_residual, eps,
                 triton, theta, lr_scale, tau_offset, dot_loss), None


# (heads, d) zeros standing in for the inner LayerNorm the dot loss does not have (read by nothing; utils.cached_constant)
_NO_NORM: Dict[Tuple, Tensor] = {}


def _no_inner_norm(q: Tensor) -> Tuple[Tensor, Tensor]:
    h, d = q.shape[1], q.shape[3]
    z = cached_constant(_NO_NORM, (h, d, q.dtype, str(q.device)), lambda: torch.zeros(h, d, device=q.device,
                                                                                        dtype=q.dtype))
    return z, z
