"""Shared T5 / DiT5 inner-MLP step: recomputing PyTorch path, one Triton kernel family, custom ops."""
from .recompute import mlp_ttt_torch, t5_swiglu_ttt_torch

__all__ = ["t5_swiglu_ttt_torch", "mlp_ttt_torch"]
