from .reference import swiglu_ttt_reference, dwconv_ttt_reference
from .recompute import dwconv_ttt_torch, qkv_ttt_naive, qkv_ttt_torch, swiglu_ttt_torch

__all__ = ["swiglu_ttt_reference", "dwconv_ttt_reference", "swiglu_ttt_torch", "dwconv_ttt_torch",
           "qkv_ttt_torch", "qkv_ttt_naive"]
