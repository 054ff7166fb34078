"""T5 (3-matrix SwiGLU) and DiT5 (2-layer SiLU MLP) inner steps: references, lean PyTorch path, one Triton kernel
family, custom ops."""
from functools import partial
from typing import Callable, Optional

from torch import Tensor

from ..backend import resolve_backend
from .naive import (last_layer_ttt_reference, mlp_inner_update_reference, mlp_ttt_reference, t5_inner_update_reference,
                    t5_swiglu_ttt_reference)
from .ops import mlp_ttt_op, t5_swiglu_ttt_op
from .torch import last_layer_ttt_torch, mlp_ttt_torch, t5_swiglu_ttt_torch

__all__ = ["t5_swiglu_ttt_reference", "t5_swiglu_ttt_torch", "t5_swiglu_ttt_op", "t5_inner_update_reference",
           "mlp_ttt_reference", "mlp_ttt_torch", "mlp_ttt_op", "mlp_inner_update_reference",
           "last_layer_ttt_reference", "last_layer_ttt_torch", "choose"]


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
