"""Plain linear-attention Vision-TTT scan (TTT-Linear with a dot-product inner loss and no inner LayerNorm):
recurrent reference, exact chunk-parallel PyTorch form, Triton forward, custom op, both scan directions."""
from .common import check_la_args, la_bidir
from .naive import la_bidir_reference, la_scan_naive
from .ops import linear_attention_op
from .torch import la_chunk_torch

__all__ = ["la_scan_naive", "la_chunk_torch", "linear_attention_op", "la_bidir", "la_bidir_reference", "check_la_args"]
