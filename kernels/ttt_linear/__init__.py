"""TTT-Linear mini-batch dual-form scan (Vision-TTT), causal and bidirectional: reference, lean PyTorch path
(with the chunked forward), Triton kernels, custom ops."""
from .common import inner_rope, token_tau
from .naive import ln_l2_grad, ttt_linear_bidir_naive, ttt_linear_naive
from .ops import ttt_linear_bidir_op, ttt_linear_op
from .torch import ttt_linear_bidir_chunked, ttt_linear_bidir_torch, ttt_linear_chunked, ttt_linear_torch

__all__ = ["ttt_linear_naive", "ttt_linear_chunked", "ttt_linear_torch", "ttt_linear_op", "ttt_linear_bidir_naive",
           "ttt_linear_bidir_chunked", "ttt_linear_bidir_torch", "ttt_linear_bidir_op", "ln_l2_grad", "inner_rope",
           "token_tau"]
