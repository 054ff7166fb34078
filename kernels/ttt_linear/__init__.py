"""TTT-Linear mini-batch dual-form scan (Vision-TTT), causal and bidirectional: reference (naive.py), one file per
PyTorch algorithm (torch.py: the recomputing scan and the switch; chunked.py: the inference forward; export.py: the
export form), Triton kernels, custom ops."""
from .common import inner_rope, token_tau
from .naive import ln_l2_grad, ttt_linear_bidir_naive, ttt_linear_naive
from .chunked import ttt_linear_bidir_chunked, ttt_linear_chunked
from .export import ttt_linear_bidir_export, ttt_linear_export
from .ops import ttt_linear_bidir_op, ttt_linear_op
from .torch import ttt_linear_bidir_torch, ttt_linear_torch

__all__ = ["ttt_linear_naive", "ttt_linear_chunked", "ttt_linear_torch", "ttt_linear_op", "ttt_linear_export",
           "ttt_linear_bidir_naive", "ttt_linear_bidir_chunked", "ttt_linear_bidir_torch", "ttt_linear_bidir_op",
           "ttt_linear_bidir_export", "ln_l2_grad", "inner_rope", "token_tau"]
