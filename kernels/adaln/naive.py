"""Plain adaLN glue (the ``torch_naive`` backend and the float64 reference of the tests), differentiated by autograd:

    modulate_norm(x) = (x - mean_c x) / sqrt(var_c x + eps) * (1 + scale) + shift
    gate_residual(x, y) = x + gate * y

per token over its C channels, (B, C) vectors broadcast over the N tokens; float32 arithmetic (float64 for float64
inputs), outputs in the inputs' promoted dtype.
"""
from typing import Tuple

import torch
from torch import Tensor

from .torch import (check_gate_residual, check_gate_residual_modulate_norm, check_modulate_norm, compute_dtype,
                    out_dtype)

__all__ = ["modulate_norm_reference", "gate_residual_reference", "gate_residual_modulate_norm_reference",
           "adaln_block_reference", "adaln_block"]


def modulate_norm_reference(x: Tensor, shift: Tensor, scale: Tensor, eps: float = 1e-6) -> Tensor:
    check_modulate_norm(x, shift, scale)
    cdt = compute_dtype(x, shift, scale)
    xf = x.to(cdt)
    mean = xf.mean(-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(-1, keepdim=True)
    h = (xf - mean) / torch.sqrt(var + eps) * (1 + scale.to(cdt)[:, None, :]) + shift.to(cdt)[:, None, :]
    return h.to(out_dtype(x, shift, scale))


def gate_residual_reference(x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
    check_gate_residual(x, y, gate)
    cdt = compute_dtype(x, y, gate)
    return (x.to(cdt) + gate.to(cdt)[:, None, :] * y.to(cdt)).to(out_dtype(x, y, gate))


def gate_residual_modulate_norm_reference(x: Tensor, y: Tensor, gate: Tensor, shift: Tensor, scale: Tensor,
                                          eps: float = 1e-6) -> Tuple[Tensor, Tensor]:
    check_gate_residual_modulate_norm(x, y, gate, shift, scale)
    x1 = gate_residual_reference(x, y, gate)
    return x1, modulate_norm_reference(x1, shift, scale, eps)


def adaln_block(modulate_norm, gate_residual, gate_residual_modulate_norm, x: Tensor, y: Tensor, mods: Tensor,
                eps: float = 1e-6) -> Tensor:
    """The three functions chained as a DiT block chains them (the op's one verification case): ``mods`` (B, 3, C)
    holds shift, scale, gate (strided views); both outputs of the fused middle step feed the last one."""
    shift, scale, gate = mods.unbind(1)
    h = modulate_norm(x, shift, scale, eps)
    x1, h2 = gate_residual_modulate_norm(x, y + h, gate, shift, scale, eps)
    return gate_residual(x1, h2, gate)


def adaln_block_reference(x: Tensor, y: Tensor, mods: Tensor, eps: float = 1e-6) -> Tensor:
    return adaln_block(modulate_norm_reference, gate_residual_reference, gate_residual_modulate_norm_reference,
                       x, y, mods, eps)
