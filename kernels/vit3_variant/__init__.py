"""ViT3 inner-loop variants (update the last layer only, a single linear layer, no gradient normalisation,
gradient ascent, queries replaced by keys, k inner steps): reference, lean PyTorch path, Triton kernels, the
``triton`` backend's entry."""
from .common import variant_qkv_split
from .naive import dwconv_variant_reference, swiglu_variant_reference, variant_qkv_naive
from .ops import variant_qkv_op
from .torch import variant_qkv_torch

__all__ = ["swiglu_variant_reference", "dwconv_variant_reference", "variant_qkv_naive", "variant_qkv_split",
           "variant_qkv_torch", "variant_qkv_op"]
