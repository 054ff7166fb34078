"""Key instance-norm of the T5 / DiT5 mixers: reference, lean PyTorch path, Triton kernels, custom ops."""
from functools import partial
from typing import Callable, Optional

from torch import Tensor

from ..backend import resolve_backend
from .naive import key_norm_reference
from .ops import key_norm_op, qk_norm_fold_op, qkv_fold_op
from .torch import identity_taps, key_norm_bwd, key_norm_fwd, key_norm_torch

__all__ = ["key_norm_reference", "key_norm_torch", "key_norm_op", "key_norm_fwd", "key_norm_bwd", "choose",
           "qk_norm_fold_op", "qkv_fold_op", "identity_taps"]


def choose(op: str, backend: Optional[str], x: Tensor, head_dim: Optional[int] = None) -> Callable:
    """The callable that runs ``op`` (``key_instance_norm``) on ``x`` (B, N, C): the reference, the PyTorch path, or the
    custom op with its Triton kernels, as ``backend.resolve_backend`` decides."""
    path = resolve_backend(backend, x.device, x.dtype, head_dim, op)
    return {"torch_naive": key_norm_reference, "torch": key_norm_torch}.get(path) or partial(key_norm_op, triton=True)
