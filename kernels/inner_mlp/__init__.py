"""T5 (3-matrix SwiGLU) and DiT5 (2-layer SiLU MLP) inner steps: references, lean PyTorch path, one Triton kernel
family, custom ops."""
from .naive import (last_layer_ttt_reference, mlp_inner_update_reference, mlp_ttt_reference, t5_inner_update_reference,
                    t5_swiglu_ttt_reference)
from .ops import mlp_ttt_op, t5_swiglu_ttt_op
from .torch import last_layer_ttt_torch, mlp_ttt_torch, t5_swiglu_ttt_torch

__all__ = ["t5_swiglu_ttt_reference", "t5_swiglu_ttt_torch", "t5_swiglu_ttt_op", "t5_inner_update_reference",
           "mlp_ttt_reference", "mlp_ttt_torch", "mlp_ttt_op", "mlp_inner_update_reference",
           "last_layer_ttt_reference", "last_layer_ttt_torch"]
