"""TTT-Linear mini-batch dual-form scan (Vision-TTT), causal and bidirectional: references, lean PyTorch path,
Triton kernels, custom ops."""
from .naive import (inner_rope, ln_l2_grad, token_tau, ttt_linear_bidir, ttt_linear_bidir_reference,
                    ttt_linear_naive, ttt_linear_reference)
from .ops import ttt_linear_bidir_op, ttt_linear_op
from .torch import ttt_linear_bidir_naive, ttt_linear_bidir_torch, ttt_linear_torch

__all__ = ["ttt_linear_reference", "ttt_linear_naive", "ttt_linear_torch", "ttt_linear_op", "ttt_linear_bidir",
           "ttt_linear_bidir_reference", "ttt_linear_bidir_naive", "ttt_linear_bidir_torch", "ttt_linear_bidir_op",
           "ln_l2_grad", "inner_rope", "token_tau"]
