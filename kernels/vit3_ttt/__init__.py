"""ViT3 / H-ViT3 / DiT3 inner steps (SwiGLU, 3x3 depthwise conv, and the mixer core with its qkv projection):
references, lean PyTorch path, Triton kernels, custom ops, and :func:`choose`, the one path decision of the folder."""
from functools import partial
from typing import Callable, Optional

from torch import Tensor

from ..backend import MAX_HEAD_DIM, compiling, resolve_backend, triton_choice
from .naive import dwconv_ttt_reference, qkv_ttt_naive, swiglu_ttt_reference
from .ops import dwconv_ttt_op, qkv_fused, qkv_torch_ops, qkv_triton_ops, swiglu_ttt_op
from .torch import dwconv_ttt_torch, qkv_ttt_torch, swiglu_ttt_torch

__all__ = ["swiglu_ttt_reference", "swiglu_ttt_torch", "swiglu_ttt_op", "dwconv_ttt_reference", "dwconv_ttt_torch",
           "dwconv_ttt_op", "qkv_ttt_naive", "qkv_ttt_torch", "qkv_ttt_op", "choose", "qkv_custom_op"]

_STEPS = {"vit3_swiglu_ttt": (swiglu_ttt_reference, swiglu_ttt_torch, swiglu_ttt_op),
          "vit3_dwconv_ttt": (dwconv_ttt_reference, dwconv_ttt_torch, dwconv_ttt_op)}


def choose(op: str, backend: Optional[str], t: Tensor, head_dim: int, custom_op: bool = False) -> Callable:
    """The callable that runs ``op`` (``vit3_swiglu_ttt``, ``vit3_dwconv_ttt``, ``vit3_qkv_ttt``) on inputs like
    ``t``: the backend (``backend.resolve_backend``: argument, process default, device, dtype, head dim), then for
    the mixer core the fused kernels within ``MAX_HEAD_DIM["vit3_qkv_fused"]`` or the per-branch ones above it, and
    under torch.compile (or ``custom_op``) the ``torch`` path as opaque custom ops.  Export and inference take the
    PyTorch path's own no-autograd form (``qkv_ttt_torch``)."""
    path = resolve_backend(backend, t.device, t.dtype, head_dim, op)
    if op in _STEPS:
        naive, lean, custom = _STEPS[op]
        return {"torch_naive": naive, "torch": lean, "triton": partial(custom, triton=True)}[path]
    if path == "torch_naive":
        return qkv_ttt_naive
    if path == "torch" and not (custom_op or compiling()):
        return qkv_ttt_torch
    return qkv_custom_op(path == "triton", head_dim)


def qkv_custom_op(triton: bool, head_dim: int) -> Callable:
    """The mixer core over the custom ops: the kernels (``triton``; the fused ones within the table's
    ``vit3_qkv_fused`` head-dim limit, the per-branch ones above), else the per-branch ops' PyTorch path."""
    if not triton:
        return qkv_torch_ops
    return qkv_fused if head_dim <= MAX_HEAD_DIM["vit3_qkv_fused"] else qkv_triton_ops


def qkv_ttt_op(x, weight, bias, w1, w2, w3, feat_size, heads: int, scale: float, normalize_grad: bool = True,
               cos=None, sin=None, triton=None, recompute: bool = True):
    """ViT3 mixer core through the custom ops, called directly (the registered ``triton`` path): ``triton`` True:
    the kernels (:func:`qkv_custom_op`), False: the per-branch ops' PyTorch path, None: the kernels where they can
    run (``backend.triton_choice``)."""
    head_dim = x.shape[-1] // heads
    triton = triton_choice(x, "vit3_qkv_ttt", head_dim) if triton is None else bool(triton)
    return qkv_custom_op(triton, head_dim)(
        x, weight, bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos, sin, recompute=recompute)
