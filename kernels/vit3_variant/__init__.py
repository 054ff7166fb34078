"""ViT3 inner-loop variants (update the last layer only, a single linear layer, no gradient normalisation,
gradient ascent, queries replaced by keys, k inner steps): reference, lean PyTorch path, Triton kernels."""
from .naive import dwconv_variant_reference, swiglu_variant_reference, variant_qkv_naive, variant_qkv_split
from .torch import variant_qkv_torch

__all__ = ["swiglu_variant_reference", "dwconv_variant_reference", "variant_qkv_naive", "variant_qkv_split",
           "variant_qkv_torch", "variant_qkv_triton"]


def variant_qkv_triton(*args, **kwargs):
    """The Triton path (imported on first use: CPU users never import Triton)."""
    from ..utils import triton_module
    return triton_module(__package__).variant_qkv_triton(*args, **kwargs)
