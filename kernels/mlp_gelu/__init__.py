"""The MLP's GELU recomputed in its backward (``layers.recompute``): ``gelu(h)`` and ``dg gelu'(h)`` from one launch,
where the PyTorch path launches ``gelu`` and ``gelu_backward``.  Float64 reference, PyTorch path, Triton kernel,
custom op; the op name of the backend choice and the GPU verification: ``mlp_gelu``."""
from functools import partial
from typing import Callable, Optional

from torch import Tensor
from torch.fx import Proxy

from ..backend import TRITON_BACKEND, resolve_backend, tracing
from .naive import gelu_linear_reference, gelu_vjp_reference
from .ops import OP, gelu_linear_op, gelu_linear_torch, gelu_vjp_op
from .torch import gelu_vjp_torch

__all__ = ["OP", "gelu_linear_op", "gelu_linear_torch", "gelu_vjp_op", "gelu_linear_reference", "gelu_vjp_reference", "gelu_vjp_torch", "triton_path"]


def _mid_vjp(approximate: str, h: Tensor, dg: Tensor):
    g, dh = gelu_vjp_op(h, dg, approximate, triton=True)
    return g, dh, []


def triton_path(h: Tensor, backend: Optional[str], approximate: str) -> Optional[Callable]:
    """For ``layers.block.TokenMlp``: the ``mid_vjp`` ``(h, dg) -> (gelu(h), dh, [])`` on the Triton kernel when
    ``backend`` resolves to Triton for ``h`` and no graph is being captured, else None (autograd's two launches)."""
    if isinstance(h, Proxy) or tracing():
        return None
    if resolve_backend(backend, h.device, h.dtype, None, OP) != TRITON_BACKEND:
        return None
    return partial(_mid_vjp, approximate)
