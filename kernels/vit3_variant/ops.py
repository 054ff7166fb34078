"""The ``triton`` backend of the ViT3 inner-loop variants: the variant mixer core over the Triton kernels.

Unlike the other folders' ops, the variant core is an ``autograd.Function`` over the kernels (``VariantQKVFused`` over
``fused.py``'s 3 + 3 launches; ``VariantQKVTriton``, built by ``torch.make_variant_function``, above the fused head-dim
limit), not a ``torch.library`` custom op; ``triton.py`` is imported on first use, so CPU users never import Triton.  ``torch.run_variant`` is the entry both paths share.
"""
from ..utils import triton_module

__all__ = ["variant_qkv_op"]


def variant_qkv_op(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
                   cos=None, sin=None, last_only: bool = False, lr: float = 1.0, share_qk: bool = False,
                   steps: int = 1):
    """Variant mixer core with the Triton kernels (same signature as ``naive.variant_qkv_naive``)."""
    return triton_module(__package__).variant_qkv_triton(x, weight, bias, w1, w2, w3, feat_size, heads, scale,
                                                         normalize_grad, cos, sin, last_only, lr, share_qk, steps)
