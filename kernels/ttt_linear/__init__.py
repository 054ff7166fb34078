"""TTT-Linear mini-batch dual-form scan (Vision-TTT), causal and bidirectional: reference (naive.py), one file per
PyTorch algorithm (torch.py: the recomputing scan; chunked.py: the inference forward; export.py: the export form),
Triton kernels, custom ops, and :func:`choose`, the one path decision of the folder."""
from functools import partial
from typing import Callable, Optional, Sequence

from torch import Tensor

from ..backend import compiling, resolve_backend
from .chunked import ttt_linear_bidir_chunked, ttt_linear_chunked
from .common import inner_rope, token_tau
from .export import ttt_linear_bidir_export, ttt_linear_export
from .naive import ln_l2_grad, ttt_linear_bidir_naive, ttt_linear_naive
from .ops import ttt_linear_bidir_op, ttt_linear_op
from .torch import torch_algorithm, ttt_linear_bidir_torch, ttt_linear_torch

__all__ = ["ttt_linear_naive", "ttt_linear_chunked", "ttt_linear_torch", "ttt_linear_op", "ttt_linear_export",
           "ttt_linear_bidir_naive", "ttt_linear_bidir_chunked", "ttt_linear_bidir_torch", "ttt_linear_bidir_op",
           "ttt_linear_bidir_export", "ln_l2_grad", "inner_rope", "token_tau", "choose"]


# per op: reference, custom-op entry (the Triton kernels, or their PyTorch path as one opaque node)
_PATHS = {"ttt_linear": (ttt_linear_naive, ttt_linear_op),
          "ttt_linear_bidir": (ttt_linear_bidir_naive, ttt_linear_bidir_op)}


def choose(op: str, backend: Optional[str], q: Tensor, head_dim: int, inputs: Sequence[Tensor] = (),
           return_grad_norm: bool = False) -> Callable:
    """The callable that runs ``op`` (``ttt_linear``, ``ttt_linear_bidir``; the reference's signature) on inputs like
    ``q``: the backend (``backend.resolve_backend``); the ``triton`` backend, and under torch.compile the ``torch``
    one too, -> the custom op (one opaque node: dynamo would unroll the loop over mini-batches into a graph fixed to
    the traced token count; torch.export takes the export form instead); else ``torch.torch_algorithm`` (export, the
    grad-norm map, inference or the recomputing scan, by ``inputs``)."""
    path = resolve_backend(backend, q.device, q.dtype, head_dim, op)
    naive, custom = _PATHS[op]
    if path == "torch_naive":
        return naive
    if not return_grad_norm and (path == "triton" or compiling()):
        return partial(custom, triton=path == "triton")
    return torch_algorithm(op == "ttt_linear_bidir", inputs, return_grad_norm)
