"""Plain linear-attention Vision-TTT scan (TTT-Linear with a dot-product inner loss and no inner LayerNorm):
recurrent reference, exact chunk-parallel PyTorch form, Triton forward, custom op, both scan directions."""
from functools import partial
from typing import Callable, Optional

from torch import Tensor

from ..backend import resolve_backend
from .bidir import linear_attention_bidir_naive, linear_attention_bidir_torch, linear_attention_bidir_triton
from .common import la_bidir
from .naive import la_bidir_reference, la_scan_naive
from .ops import linear_attention_op
from .torch import la_chunk_torch

__all__ = ["la_scan_naive", "la_chunk_torch", "linear_attention_op", "la_bidir", "la_bidir_reference", "choose",
           "linear_attention_bidir_naive", "linear_attention_bidir_torch", "linear_attention_bidir_triton"]


def choose(op: str, backend: Optional[str], q: Tensor, head_dim: int) -> Callable:
    """The single-direction scan for ``op`` (``linear_attention``) on inputs like ``q`` (B, heads, N, d): the recurrent
    reference, the chunk-parallel PyTorch form, or the custom op with its Triton forward (``backend.resolve_backend``)."""
    path = resolve_backend(backend, q.device, q.dtype, head_dim, op)
    return {"torch_naive": la_scan_naive, "torch": la_chunk_torch}.get(path) or partial(linear_attention_op,
                                                                                         triton=True)
