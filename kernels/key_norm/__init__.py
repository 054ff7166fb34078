"""Key instance-norm of the T5 / DiT5 mixers: reference, lean PyTorch path, Triton kernels, custom ops."""
from .naive import key_norm_reference
from .ops import key_norm_op
from .torch import key_norm_bwd, key_norm_fwd, key_norm_torch

__all__ = ["key_norm_reference", "key_norm_torch", "key_norm_op", "key_norm_fwd", "key_norm_bwd"]
