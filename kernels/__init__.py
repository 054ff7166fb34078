"""TTT ops (installed as ``ttt_zoo.kernels``): one folder per op with its reference and kernels."""
from typing import Optional, Tuple

import torch
from timm.layers import register_notrace_function

from .dispatch import available_ops, get_op, register_op, resolve_backend
from .vit3_ttt import (dwconv_ttt_reference, dwconv_ttt_torch, qkv_ttt_naive, qkv_ttt_torch, swiglu_ttt_reference,
                       swiglu_ttt_torch)

from .dit5_ttt import mlp_ttt, mlp_ttt_reference  # noqa: E402
from .inner_mlp import mlp_ttt_torch, t5_swiglu_ttt_torch  # noqa: E402
from .inner_mlp.ops import mlp_ttt_triton_entry, t5_swiglu_ttt_triton_entry  # noqa: E402
from .key_norm import key_norm_reference, key_norm_torch  # noqa: E402
from .key_norm.ops import key_norm_triton_entry  # noqa: E402
from .t5_ttt import t5_swiglu_ttt_reference  # noqa: E402
from .ttt_linear import (inner_rope, token_tau, ttt_linear_bidir_reference, ttt_linear_naive,  # noqa: E402
                         ttt_linear_reference)
from .ttt_linear.ops import ttt_linear_bidir_op, ttt_linear_op  # noqa: E402
from .ttt_linear.recompute import ttt_linear_bidir_naive, ttt_linear_bidir_torch, ttt_linear_torch  # noqa: E402
from .vit3_ttt.ops import HAS_TRITON, dwconv_ttt_op, qkv_ttt_op, swiglu_ttt_op  # noqa: E402

# torch: recomputing PyTorch path (any device); triton: the ttt_zoo::vit3_* custom ops (Triton kernels on CUDA);
# torch_naive: the plain reference under autograd.  Without Triton installed, forcing 'triton' raises.
register_op("vit3_swiglu_ttt", swiglu_ttt_torch, swiglu_ttt_op if HAS_TRITON else None, swiglu_ttt_reference)
register_op("vit3_dwconv_ttt", dwconv_ttt_torch, dwconv_ttt_op if HAS_TRITON else None, dwconv_ttt_reference)
register_op("vit3_qkv_ttt", qkv_ttt_torch, qkv_ttt_op if HAS_TRITON else None, qkv_ttt_naive)
# T5 / DiT5 inner steps and the key instance-norm: same three backends (ttt_zoo::t5_*, dit5_*, key_instance_norm_*)
register_op("dit5_mlp_ttt", mlp_ttt_torch, mlp_ttt_triton_entry if HAS_TRITON else None, mlp_ttt_reference)
register_op("t5_swiglu_ttt", t5_swiglu_ttt_torch, t5_swiglu_ttt_triton_entry if HAS_TRITON else None,
            t5_swiglu_ttt_reference)
register_op("key_instance_norm", key_norm_torch, key_norm_triton_entry if HAS_TRITON else None, key_norm_reference)
# TTT-Linear (Vision-TTT): one direction, and both directions in one launch (ttt_zoo::ttt_linear_scan_*)
register_op("ttt_linear", ttt_linear_torch, ttt_linear_op if HAS_TRITON else None, ttt_linear_naive)
register_op("ttt_linear_bidir", ttt_linear_bidir_torch, ttt_linear_bidir_op if HAS_TRITON else None,
            ttt_linear_bidir_naive)


def swiglu_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               scale: float, normalize_grad: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """ViT3 SwiGLU inner step + apply; see ``vit3_ttt.reference.swiglu_ttt_reference``."""
    if torch.jit.is_scripting():
        return swiglu_ttt_reference(q, k, v, w1, w2, scale, normalize_grad)
    return get_op("vit3_swiglu_ttt", q.device, backend)(q, k, v, w1, w2, scale, normalize_grad)


def dwconv_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w3: torch.Tensor,
               scale: float, normalize_grad: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """ViT3 3x3 depthwise-conv inner step + apply; see ``vit3_ttt.reference.dwconv_ttt_reference``."""
    if torch.jit.is_scripting():
        return dwconv_ttt_reference(q, k, v, w3, scale, normalize_grad)
    return get_op("vit3_dwconv_ttt", q.device, backend)(q, k, v, w3, scale, normalize_grad)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device
def t5_swiglu_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor, scale: float, backend: Optional[str] = None) -> torch.Tensor:
    """T5 3-matrix SwiGLU inner step + apply; see ``t5_ttt.reference.t5_swiglu_ttt_reference``."""
    if torch.jit.is_scripting():
        return t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, scale)
    return get_op("t5_swiglu_ttt", q.device, backend)(q, k, v, w1, w2, w3, scale)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device
def key_instance_norm(k: torch.Tensor, eps: float = 1.0, backend: Optional[str] = None) -> torch.Tensor:
    """T5 / DiT5 key instance-norm of (B, N, C) tokens over N; see ``key_norm.reference``."""
    if torch.jit.is_scripting():
        return key_norm_reference(k, eps)
    return get_op("key_instance_norm", k.device, backend)(k, eps)


def vit3_qkv_ttt(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], w1: torch.Tensor,
                 w2: torch.Tensor, w3: torch.Tensor, feat_size: Tuple[int, int], heads: int, scale: float,
                 normalize_grad: bool = True, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                 backend: Optional[str] = None) -> torch.Tensor:
    """ViT3 mixer core: qkv projection (+ optional RoPE on the SwiGLU q, k), both inner steps, concat.

    (B, N, C) -> (B, N, C + d).  The default paths store only ``x`` for the backward and recompute the projection.
    """
    return get_op("vit3_qkv_ttt", x.device, backend)(x, weight, bias, w1, w2, w3, feat_size, heads, scale,
                                                     normalize_grad, cos, sin)


def ttt_linear(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch=16, ln_residual=True, eps=1e-6,
               return_grad_norm=False, backend=None):
    """Causal TTT-Linear mini-batch scan; see ``ttt_linear.reference.ttt_linear_reference``.

    torch: recomputing backward (``ttt_linear.recompute``); triton: the fused scan kernels; torch_naive: the plain
    per-mini-batch scan (``ttt_linear_naive``) under autograd.
    """
    return get_op("ttt_linear", q.device, backend)(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual,
                                                    eps, return_grad_norm)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device, the scan loops over mini-batches
def ttt_linear_bidir(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                     w0: torch.Tensor, b0: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, mini_batch: int = 16,
                     ln_residual: bool = True, rope_theta: Optional[float] = 10000.0, eps: float = 1e-6,
                     return_grad_norm: bool = False, backend: Optional[str] = None
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward + flipped TTT-Linear scans, summed (Vision-TTT Eq. 12); see ``ttt_linear.reference.ttt_linear_bidir``.

    torch: both directions batched, recomputing backward; triton: both directions in one kernel launch;
    torch_naive: the plain per-mini-batch scan under autograd.  ``return_grad_norm=True`` runs a PyTorch scan.
    TorchScript compiles the reference scan (``ttt_linear.reference.ttt_linear_bidir_reference``).
    """
    if torch.jit.is_scripting():
        return ttt_linear_bidir_reference(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, rope_theta,
                                          eps, return_grad_norm)
    return get_op("ttt_linear_bidir", q.device, backend)(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch,
                                                          ln_residual, rope_theta, eps, return_grad_norm)


__all__ = ["available_ops", "get_op", "register_op", "resolve_backend",
           "swiglu_ttt", "dwconv_ttt", "vit3_qkv_ttt", "swiglu_ttt_reference", "dwconv_ttt_reference",
           "swiglu_ttt_torch", "dwconv_ttt_torch", "mlp_ttt", "mlp_ttt_reference", "mlp_ttt_torch", "t5_swiglu_ttt",
           "t5_swiglu_ttt_reference", "t5_swiglu_ttt_torch", "key_instance_norm", "key_norm_reference",
           "key_norm_torch", "ttt_linear", "ttt_linear_bidir", "ttt_linear_reference", "ttt_linear_bidir_reference",
           "inner_rope", "token_tau"]
