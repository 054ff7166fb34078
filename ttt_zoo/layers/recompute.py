"""An MLP's output layer that keeps its wide input out of training memory.

In ``fc2(mid(fc1(x)))`` autograd keeps ``fc1(x)`` (for ``mid``'s backward) *and* ``mid(fc1(x))`` (for fc2's
weight gradient): two hidden-wide tensors per block, the largest activations of every family here. ``mid`` is
elementwise (GELU, SwiGLU) or a depthwise 3x3 conv plus activations, so :func:`linear_of_recomputed` keeps only
``fc1(x)`` and recomputes ``mid`` in the backward (a few percent of the MLP's time; no GEMM is repeated).

Not ``torch.utils.checkpoint``: checkpointing ``fc2 . mid`` recomputes fc2's GEMM, and selective checkpointing
(save the matmuls, recompute the rest) also caches fc2's output. Under ``torch.compile`` this is not used:
inductor's partitioner already recomputes pointwise ops.
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from ttt_zoo.kernels.utils import autocast_state, no_autocast

__all__ = ["linear_of_recomputed", "can_recompute"]


class _LinearOfRecomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mid: Callable, mid_vjp: Optional[Callable], h: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], *params):
        ctx.mid, ctx.mid_vjp, ctx.has_bias = mid, mid_vjp, bias is not None
        ctx.amp = autocast_state(h.device)
        ctx.save_for_backward(h, weight, *params)
        return F.linear(mid(h, *params), weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        h, weight, *params = ctx.saved_tensors
        if ctx.mid_vjp is not None:  # mid's output and its gradients from one fused backward
            with no_autocast(h.device, *ctx.amp):
                dg = torch.matmul(dy, weight)
                g, d_h, d_params = ctx.mid_vjp(h, dg.to(h.dtype), *params)
        else:
            with torch.enable_grad(), no_autocast(h.device, *ctx.amp):  # the forward's autocast state
                h_ = h.detach().requires_grad_(ctx.needs_input_grad[2])
                params_ = [p.detach().requires_grad_(need) for p, need in zip(params, ctx.needs_input_grad[5:])]
                g = ctx.mid(h_, *params_)
                dg = torch.matmul(dy, weight)  # autocast casts as the forward's F.linear did
        d_weight = d_bias = None
        if ctx.needs_input_grad[3]:
            d_weight = (dy.reshape(-1, dy.shape[-1]).t().to(g.dtype) @ g.detach().reshape(-1, g.shape[-1]))
            d_weight = d_weight.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            d_bias = dy.reshape(-1, dy.shape[-1]).sum(0).to(weight.dtype)
        if ctx.mid_vjp is None:
            wanted = [t for t in (h_, *params_) if t.requires_grad]
            got = iter(torch.autograd.grad(g, wanted, dg.to(g.dtype)) if wanted else ())
            d_h = next(got) if h_.requires_grad else None
            d_params = [next(got) if p.requires_grad else None for p in params_]
        else:
            d_h = d_h if ctx.needs_input_grad[2] else None
            d_params = [d if need else None for d, need in zip(d_params, ctx.needs_input_grad[5:])]
        return (None, None, d_h, d_weight, d_bias, *d_params)


def linear_of_recomputed(mid: Callable[..., torch.Tensor], h: torch.Tensor, linear: nn.Linear,
                         *params: torch.Tensor, mid_vjp: Optional[Callable] = None) -> torch.Tensor:
    """``linear(mid(h, *params))``, keeping ``h`` but not ``mid(h)`` for the backward.

    ``mid`` must be deterministic (no dropout) and take its parameters as arguments (``params``), so that their
    gradients flow through this function.  ``mid_vjp(h, dg, *params) -> (mid(h), dh, [dparam, ...])``, where given,
    replaces the backward's recompute-then-autograd of ``mid`` (a kernel that writes ``mid(h)`` as it goes).
    """
    return _LinearOfRecomputed.apply(mid, mid_vjp, h, linear.weight, linear.bias, *params)


def can_recompute(module: nn.Module, h: torch.Tensor) -> bool:
    """Whether ``module`` (an MLP) may take the recomputing path for input ``h``: eager training with autograd
    recording, no hooks that would miss the bypassed submodules' calls, no active dropout."""
    if isinstance(h, torch.fx.Proxy) or torch.compiler.is_compiling():
        return False
    if not torch.is_grad_enabled() or not getattr(module, "recompute_act", True):
        return False
    if not (h.requires_grad or any(p.requires_grad for p in module.parameters())):
        return False
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    for sub in module.modules():
        if sub._forward_hooks or sub._forward_pre_hooks:
            return False
        if isinstance(sub, nn.Dropout) and sub.p > 0 and sub.training:
            return False
    return True
