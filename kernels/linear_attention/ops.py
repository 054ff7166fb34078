"""The linear-attention Vision-TTT scan as a ``torch.library`` custom op (``ttt_zoo::linear_attention_fwd``).

The forward runs the Triton kernel when its last argument ``triton`` says so (the backend the caller chose once:
``backend.resolve_backend``), the chunk-parallel PyTorch form otherwise; a fake (meta) impl lets ``torch.compile`` and meta-device models see an
opaque node.  The backward recomputes the chunk-parallel form (``torch.py``) and differentiates it.
"""
from typing import List

import torch
from torch import Tensor

from ..backend import triton_choice
from ..utils import count_flops_as, launches_kernel, triton_module
from ..ttt_linear.common import check_scan_args
from .torch import la_chunk_torch

__all__ = ["la_fwd_op", "linear_attention_op"]


@torch.library.custom_op("ttt_zoo::linear_attention_fwd", mutates_args=())
def la_fwd_op(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
              mini_batch: int, triton: bool) -> Tensor:
    if launches_kernel(triton, q):
        return triton_module(__package__).la_fwd_triton(q, k, v, lr, tau, w0, b0, mini_batch)
    return la_chunk_torch(q, k, v, lr, tau, w0, b0, mini_batch).contiguous()


@la_fwd_op.register_fake
def _(q, k, v, lr, tau, w0, b0, mini_batch, triton):
    return torch.empty_like(q)


def _chunk_vjp(do: Tensor, ins, mini_batch: int) -> List[Tensor]:
    """Gradients of the chunk-parallel form (recomputed under autograd; the backward runs above the dispatcher)."""
    ins = [t.detach().requires_grad_(True) for t in ins]
    with torch.enable_grad():
        grads = torch.autograd.grad(la_chunk_torch(*ins, mini_batch), ins, do, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, ins)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])
    ctx.mini_batch = inputs[7]


def _backward(ctx, do):
    return (*_chunk_vjp(do, ctx.saved_tensors, ctx.mini_batch), None, None)


la_fwd_op.register_autograd(_backward, setup_context=_setup)
count_flops_as(la_fwd_op, la_chunk_torch)


def linear_attention_op(q, k, v, lr, tau, w0, b0, mini_batch: int = 16, triton=None) -> Tensor:
    """The scan through the custom op (the ``triton`` backend; ``triton`` as ``backend.triton_choice``); arguments
    as ``naive.la_scan_naive``."""
    check_scan_args(q, k, v, lr, tau, w0, b0, mini_batch, state_per_sample=True)
    triton = triton_choice(q, "linear_attention", q.shape[-1]) if triton is None else bool(triton)
    return la_fwd_op(q, k, v, lr, tau, w0, b0, int(mini_batch), triton)
