"""Several ``nn.Linear`` layers on one input as one GEMM, their parameters kept apart.

``joint_linear(x, [(w1, b1), (w2, b2)])`` equals ``torch.cat([F.linear(x, w1, b1), F.linear(x, w2, b2)], -1)``.
Eager autograd would join the parameters with two ``cat`` launches per call (weights, biases), and autocast would
cast each; here one ``cat`` writes weights and biases into one buffer (cast once where autocast is on), and the
backward hands each parameter a view of one dW GEMM and one bias sum.  A step launches 2 kernels forward (cat,
GEMM) and 3 backward (dx, dW, db), against two separate ``nn.Linear``'s 2 and 6; autocast adds one cast each way
(the joined buffer; dW to the parameters' dtype; db is summed in it), where it casts each weight and bias twice.
"""
import contextlib
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ttt_zoo.kernels.utils import cached_constant

__all__ = ["joint_linear"]

_ZEROS: Dict[Hashable, torch.Tensor] = {}


def _zeros(n: int, like: torch.Tensor) -> torch.Tensor:
    return cached_constant(_ZEROS, (n, like.device, like.dtype), lambda: torch.zeros(n, device=like.device,
                                                                                       dtype=like.dtype))


class _JointLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, *params: Optional[torch.Tensor]) -> torch.Tensor:
        ws, bs = params[0::2], params[1::2]
        rows = [w.shape[0] for w in ws]
        out_features, cin = sum(rows), ws[0].shape[1]
        dev = x.device.type
        amp = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
        dt = torch.get_autocast_dtype(dev) if amp else ws[0].dtype
        parts = [w.reshape(-1) for w in ws] + [b if b is not None else _zeros(r, ws[0]) for b, r in zip(bs, rows)]
        buf = torch.cat(parts).to(dt)  # one launch, and autocast's one cast (CUDA's cat casts only as per-part copies)
        w, b = buf[:out_features * cin].view(out_features, cin), buf[out_features * cin:]
        xc = x.to(dt)
        ctx.save_for_backward(xc, w)
        ctx.rows = rows
        ctx.param_dtype = ws[0].dtype
        with torch.autocast(dev, enabled=False) if amp else contextlib.nullcontext():
            return F.linear(xc, w, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        xc, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)
        dx = (g @ w).view(xc.shape) if need[0] else None
        dws: Sequence[Optional[torch.Tensor]] = [None] * len(ctx.rows)
        dbs: Sequence[Optional[torch.Tensor]] = [None] * len(ctx.rows)
        if any(need[1::2]):
            dws = (g.t() @ xc.reshape(-1, xc.shape[-1])).to(ctx.param_dtype).split(ctx.rows, 0)
        if any(need[2::2]):
            dbs = g.sum(0, dtype=ctx.param_dtype).split(ctx.rows, 0)  # accumulated and written in the parameters' dtype
        out: List[Optional[torch.Tensor]] = [dx]
        for i in range(len(ctx.rows)):
            out += [dws[i] if need[1 + 2 * i] else None, dbs[i] if need[2 + 2 * i] else None]
        return tuple(out)


def joint_linear(x: torch.Tensor, layers: Sequence[Tuple[torch.Tensor, Optional[torch.Tensor]]]) -> torch.Tensor:
    """``cat([F.linear(x, w, b) for w, b in layers], -1)`` as one GEMM (see the module docstring)."""
    params: List[Optional[torch.Tensor]] = []
    for w, b in layers:
        params += [w, b]
    return _JointLinear.apply(x, *params)
