"""ViT3 / H-ViT3 / DiT3 inner steps (SwiGLU, 3x3 depthwise conv, and the mixer core with its qkv projection):
references, lean PyTorch path, Triton kernels, custom ops."""
from .naive import dwconv_ttt_reference, qkv_ttt_naive, swiglu_ttt_reference
from .ops import dwconv_ttt_op, qkv_ttt_op, swiglu_ttt_op
from .torch import dwconv_ttt_torch, qkv_ttt_torch, swiglu_ttt_torch

__all__ = ["swiglu_ttt_reference", "swiglu_ttt_torch", "swiglu_ttt_op", "dwconv_ttt_reference", "dwconv_ttt_torch",
           "dwconv_ttt_op", "qkv_ttt_naive", "qkv_ttt_torch", "qkv_ttt_op"]
