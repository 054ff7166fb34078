"""Residual depthwise 3x3 conv ``act(x + dwconv3x3(x))`` on (B, N, C) tokens (the blocks' CPE and H-ViT3's MLP
branch): float64-capable reference, PyTorch path, Triton kernels, custom ops."""
from functools import partial
from typing import Callable, Optional

from torch import Tensor
from torch.fx import Proxy

from ..backend import TRITON_BACKEND, resolve_backend, tracing
from .naive import residual_dwconv_reference
from .ops import OP, residual_dwconv_op, residual_dwconv_vjp
from .torch import residual_dwconv_torch

__all__ = ["residual_dwconv_reference", "residual_dwconv_torch", "residual_dwconv_op", "residual_dwconv_vjp", "choose",
           "triton_path", "OP"]


def choose(op: str, backend: Optional[str], x: Tensor) -> Callable:
    """The callable that runs ``op`` (``residual_dwconv3x3``) on ``x``: the reference, the PyTorch path, or the custom
    op with its Triton kernels, as ``backend.resolve_backend`` decides."""
    path = resolve_backend(backend, x.device, x.dtype, None, op)
    return {"torch_naive": residual_dwconv_reference, "torch": residual_dwconv_torch}.get(path) or \
        partial(residual_dwconv_op, triton=True)


def triton_path(x: Tensor, backend: Optional[str]) -> Optional[Callable]:
    """For the layers, which keep their own aten conv otherwise: the op's Triton path when ``backend`` resolves to
    Triton for ``x`` and no graph is being captured (torch.fx, TorchScript, torch.compile and the exporters keep the
    aten ops), else None."""
    if isinstance(x, Proxy) or tracing():
        return None
    if resolve_backend(backend, x.device, x.dtype, None, OP) != TRITON_BACKEND:
        return None
    return partial(residual_dwconv_op, triton=True)
