"""T5 (3-matrix SwiGLU) and DiT5 (2-layer SiLU MLP) inner steps: references, lean PyTorch path, one Triton kernel
family, custom ops."""
from functools import partial
from typing import Callable, Optional

import torch as _torch  # not ``torch``: that name is this package's PyTorch-path submodule
from timm.layers import register_notrace_function
from torch import Tensor

from ..backend import resolve_backend
from .naive import (last_layer_ttt_reference, mlp_inner_update_reference, mlp_ttt_reference, t5_inner_update_reference,
                    t5_swiglu_ttt_reference)
from .ops import mlp_ttt_op, t5_swiglu_ttt_op
from .torch import last_layer_ttt_torch, mlp_ttt_torch, t5_swiglu_ttt_torch

__all__ = ["t5_swiglu_ttt_reference", "t5_swiglu_ttt_torch", "t5_swiglu_ttt_op", "t5_inner_update_reference",
           "mlp_ttt_reference", "mlp_ttt_torch", "mlp_ttt_op", "mlp_inner_update_reference",
           "last_layer_ttt_reference", "last_layer_ttt_torch", "choose", "t5_swiglu_ttt_mix", "mlp_ttt_mix"]


_PATHS = {"t5_swiglu_ttt": (t5_swiglu_ttt_reference, t5_swiglu_ttt_torch, t5_swiglu_ttt_op),
          "dit5_mlp_ttt": (mlp_ttt_reference, mlp_ttt_torch, mlp_ttt_op),
          "last_layer_ttt": (last_layer_ttt_reference, last_layer_ttt_torch, None)}


def choose(op: str, backend: Optional[str], q: Tensor, head_dim: int) -> Callable:
    """The callable that runs ``op`` (``t5_swiglu_ttt``, ``dit5_mlp_ttt``, ``last_layer_ttt``) on inputs like ``q``
    (B, heads, N, d): the reference, the recomputing PyTorch path, or the custom op with its Triton kernels, as
    ``backend.resolve_backend`` decides (``last_layer_ttt`` has no kernel: GEMMs, cuBLAS already is one)."""
    naive, lean, custom = _PATHS[op]
    path = resolve_backend(backend, q.device, q.dtype, head_dim, op)
    return {"torch_naive": naive, "torch": lean}.get(path) or partial(custom, triton=True)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device
def t5_swiglu_ttt_mix(q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, scale: float,
                      mix: Tensor, mix_weight: float, backend: Optional[str] = None) -> Tensor:
    """``(1 - mix_weight) t5_swiglu_ttt(...) + mix_weight mix`` as one op (T5+: 0.5 TTT + 0.5 NA): the Triton
    path blends in its apply kernel and writes d mix in its backward, the PyTorch paths blend with one op."""
    if _torch.jit.is_scripting():
        return t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, scale, mix, mix_weight)
    return choose("t5_swiglu_ttt", backend, q, q.shape[-1])(q, k, v, w1, w2, w3, scale, mix=mix,
                                                             mix_weight=mix_weight)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device
def mlp_ttt_mix(q: Tensor, k: Tensor, v: Tensor, w1: Tensor, w2: Tensor, scale: float, mix: Tensor,
                mix_weight: float, backend: Optional[str] = None) -> Tensor:
    """``(1 - mix_weight) mlp_ttt(...) + mix_weight mix`` as one op (DiT5: 0.5 TTT + 0.5 NA), as above."""
    if _torch.jit.is_scripting():
        return mlp_ttt_reference(q, k, v, w1, w2, scale, mix, mix_weight)
    return choose("dit5_mlp_ttt", backend, q, q.shape[-1])(q, k, v, w1, w2, scale, mix=mix, mix_weight=mix_weight)
