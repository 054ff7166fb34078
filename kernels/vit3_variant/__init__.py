"""ViT3 inner-loop variants (update the last layer only, a single linear layer, no gradient normalisation,
gradient ascent, queries replaced by keys, k inner steps): reference, lean PyTorch path, Triton kernels, the
``triton`` backend's entry."""
from typing import Callable, Optional

from torch import Tensor

from ..backend import resolve_backend
from .common import variant_qkv_split
from .naive import dwconv_variant_reference, swiglu_variant_reference, variant_qkv_naive
from .ops import variant_qkv_op
from .torch import variant_qkv_torch

__all__ = ["swiglu_variant_reference", "dwconv_variant_reference", "variant_qkv_naive", "variant_qkv_split",
           "variant_qkv_torch", "variant_qkv_op", "choose"]


def choose(op: str, backend: Optional[str], x: Tensor, head_dim: int) -> Callable:
    """The callable that runs ``op`` (``vit3_variant_qkv_ttt``) on ``x`` (B, N, C): the reference, the PyTorch path (its
    export / inference form decided inside ``torch.run_variant``), or the Triton kernels (``backend.resolve_backend``)."""
    path = resolve_backend(backend, x.device, x.dtype, head_dim, op)
    return {"torch_naive": variant_qkv_naive, "torch": variant_qkv_torch, "triton": variant_qkv_op}[path]
