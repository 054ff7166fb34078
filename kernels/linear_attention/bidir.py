"""The linear-attention Vision-TTT scan in both directions, summed, as one op: ``linear_attention_bidir``, the op
the linear-attention forms (``visionttt_*_la``: TTT-Linear with ``inner_loss='dot'``) are chosen and verified by.

Its three paths take the same arguments: ``torch`` the chunk-parallel form of each direction (``torch.py``),
``torch_naive`` the recurrent reference (``naive.la_bidir_reference``), ``triton`` the TTT-Linear scan kernels
with the dot inner loss (``ttt_linear.ops.ttt_linear_bidir_op(..., dot_loss=True)``: the kernels this op's GPU
verification covers, ``verify.kernel_sources``).  As the layer calls the kernels, ``lr_scale`` != 0 means ``lr``
holds logits (the rate is ``lr_scale * sigmoid(lr)``, a negative scale is gradient ascent) and ``tau_offset`` means
``tau`` holds ``token_tau``'s offsets; the kernels form both, the PyTorch paths form them first.
"""
from typing import Optional

import torch
from torch import Tensor

from ..backend import triton_choice
from ..ttt_linear.common import token_tau
from ..ttt_linear.ops import ttt_linear_bidir_op
from .common import la_bidir
from .naive import la_bidir_reference
from .torch import la_chunk_torch

__all__ = ["la_bidir_rates", "linear_attention_bidir_naive", "linear_attention_bidir_torch",
           "linear_attention_bidir_triton"]


def la_bidir_rates(lr: Tensor, tau: Tensor, lr_scale: float = 0.0, tau_offset: bool = False):
    """The per-token rates and the position factors the scans read (from logits / offsets where so flagged)."""
    return (lr_scale * torch.sigmoid(lr) if lr_scale != 0 else lr), (token_tau(tau) if tau_offset else tau)


def linear_attention_bidir_torch(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                                 mini_batch: int = 16, rope_theta: Optional[float] = 10000.0, lr_scale: float = 0.0,
                                 tau_offset: bool = False) -> Tensor:
    """Both directions through the chunk-parallel form (the ``torch`` path); arguments as the module says."""
    lr, tau = la_bidir_rates(lr, tau, lr_scale, tau_offset)
    return la_bidir(la_chunk_torch, q, k, v, lr, tau, w0, b0, mini_batch, rope_theta)


def linear_attention_bidir_naive(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                                 mini_batch: int = 16, rope_theta: Optional[float] = 10000.0, lr_scale: float = 0.0,
                                 tau_offset: bool = False) -> Tensor:
    """Both directions through the recurrent reference (the ``torch_naive`` path)."""
    lr, tau = la_bidir_rates(lr, tau, lr_scale, tau_offset)
    return la_bidir_reference(q, k, v, lr, tau, w0, b0, mini_batch, rope_theta)


def linear_attention_bidir_triton(q: Tensor, k: Tensor, v: Tensor, lr: Tensor, tau: Tensor, w0: Tensor, b0: Tensor,
                                  mini_batch: int = 16, rope_theta: Optional[float] = 10000.0, lr_scale: float = 0.0,
                                  tau_offset: bool = False, triton: Optional[bool] = None) -> Tensor:
    """Both directions in the TTT-Linear scan kernels with the dot loss (the ``triton`` path; ``triton`` as
    ``backend.triton_choice`` under this op's name)."""
    triton = triton_choice(q, "linear_attention_bidir", q.shape[-1]) if triton is None else bool(triton)
    return ttt_linear_bidir_op(q, k, v, lr, tau, w0, b0, None, None, mini_batch, False, rope_theta, 1e-6,
                               triton=triton, lr_scale=lr_scale, tau_offset=tau_offset, dot_loss=True)[0]
