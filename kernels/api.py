"""The TTT op functions that ``ttt_zoo.kernels`` exports: one folder per op with its reference and kernels."""
from typing import Optional, Tuple

import torch
from timm.layers import register_notrace_function

from .backend import (BACKENDS, BackendError, available_ops, get_op, register_op, resolve_backend, set_backend,
                      use_backend)
from . import adaln, dwconv, inner_mlp, key_norm, linear_attention, mlp_gelu, ttt_linear as _ttt_linear, vit3_ttt, vit3_variant
from .dwconv import residual_dwconv_op, residual_dwconv_reference, residual_dwconv_torch
from .inner_mlp import (last_layer_ttt_reference, last_layer_ttt_torch, mlp_inner_update_reference, mlp_ttt_op, mlp_ttt_reference, mlp_ttt_torch, t5_swiglu_ttt_op, t5_swiglu_ttt_reference,
                        t5_swiglu_ttt_torch)
from .linear_attention import (la_bidir, la_chunk_torch, la_scan_naive, linear_attention_bidir_naive,
                               linear_attention_bidir_torch, linear_attention_bidir_triton, linear_attention_op)
from .key_norm import key_norm_op, key_norm_reference, key_norm_torch
from .ttt_linear import (inner_rope, token_tau, ttt_linear_bidir_chunked, ttt_linear_bidir_naive, ttt_linear_bidir_op,
                         ttt_linear_bidir_torch, ttt_linear_naive, ttt_linear_op, ttt_linear_torch)
from .vit3_variant import variant_qkv_naive, variant_qkv_op, variant_qkv_torch
from .vit3_ttt import (dwconv_ttt_op, dwconv_ttt_reference, dwconv_ttt_torch, qkv_ttt_naive, qkv_ttt_op, qkv_ttt_torch,
                       swiglu_ttt_op, swiglu_ttt_reference, swiglu_ttt_torch)

# every op's paths, for the tools and ``backend.available_ops``: torch (the lean PyTorch path, any device), triton (the
# ttt_zoo::* custom op, whose kernels run Triton), torch_naive (the reference under autograd).  Each wrapper below
# asks its folder's ``choose()`` (one per op folder) for the callable to run, once per call; TorchScript compiles
# the wrapper's ``is_scripting`` branch (the reference) instead.
register_op("vit3_swiglu_ttt", swiglu_ttt_torch, swiglu_ttt_op, swiglu_ttt_reference)
register_op("vit3_dwconv_ttt", dwconv_ttt_torch, dwconv_ttt_op, dwconv_ttt_reference)
register_op("vit3_qkv_ttt", qkv_ttt_torch, qkv_ttt_op, qkv_ttt_naive)
register_op("vit3_variant_qkv_ttt", variant_qkv_torch, variant_qkv_op, variant_qkv_naive)
register_op("dit5_mlp_ttt", mlp_ttt_torch, mlp_ttt_op, mlp_ttt_reference)
register_op("t5_swiglu_ttt", t5_swiglu_ttt_torch, t5_swiglu_ttt_op, t5_swiglu_ttt_reference)
register_op("key_instance_norm", key_norm_torch, key_norm_op, key_norm_reference)
# the blocks' CPE and H-ViT3's MLP conv: act(x + dwconv3x3(x)) on (B, N, C) tokens
register_op("residual_dwconv3x3", residual_dwconv_torch, residual_dwconv_op, residual_dwconv_reference)
# the DiT blocks' adaLN glue (modulate_norm, gate_residual and both fused; the blocks call them through
# ``adaln.triton_path``): checked as the three chained as a block chains them
register_op("adaln_modulate", adaln.adaln_block_torch, adaln.adaln_block_op, adaln.adaln_block_reference)
# the MLPs' GELU recomputed with its gradient in one launch (``layers.block.TokenMlp`` through
# ``mlp_gelu.triton_path``): checked inside the fc2 it feeds, F.linear(gelu(h), W), as the recomputing backward runs it
register_op("mlp_gelu", mlp_gelu.gelu_linear_torch, mlp_gelu.gelu_linear_op, mlp_gelu.gelu_linear_reference)
register_op("ttt_linear", ttt_linear_torch, ttt_linear_op, ttt_linear_naive)
register_op("ttt_linear_bidir", ttt_linear_bidir_torch, ttt_linear_bidir_op, ttt_linear_bidir_naive)
# the variants' fast paths ("TTT with KV Binding Is Secretly Linear Attention", Table 2): the T5/DiT5 V1/V3
# last-layer step (GEMMs: no Triton kernel, cuBLAS already is one) and the linear-attention Vision-TTT scan
register_op("last_layer_ttt", last_layer_ttt_torch, None, last_layer_ttt_reference)
register_op("linear_attention", la_chunk_torch, linear_attention_op, la_scan_naive)
# the linear-attention forms' scan, both directions (TTT-Linear's dot inner loss): chosen and verified as its own op,
# its Triton path the TTT-Linear scan kernels (DOT)
register_op("linear_attention_bidir", linear_attention_bidir_torch, linear_attention_bidir_triton,
            linear_attention_bidir_naive)


def swiglu_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               scale: float, normalize_grad: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """ViT3 SwiGLU inner step + apply; see ``vit3_ttt.naive.swiglu_ttt_reference``."""
    if torch.jit.is_scripting():
        return swiglu_ttt_reference(q, k, v, w1, w2, scale, normalize_grad)
    return vit3_ttt.choose("vit3_swiglu_ttt", backend, q, q.shape[-1])(q, k, v, w1, w2, scale, normalize_grad)


def dwconv_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w3: torch.Tensor,
               scale: float, normalize_grad: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """ViT3 3x3 depthwise-conv inner step + apply; see ``vit3_ttt.naive.dwconv_ttt_reference``."""
    if torch.jit.is_scripting():
        return dwconv_ttt_reference(q, k, v, w3, scale, normalize_grad)
    return vit3_ttt.choose("vit3_dwconv_ttt", backend, q, q.shape[1])(q, k, v, w3, scale, normalize_grad)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device
def t5_swiglu_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor, scale: float, backend: Optional[str] = None) -> torch.Tensor:
    """T5 3-matrix SwiGLU inner step + apply; see ``inner_mlp.naive.t5_swiglu_ttt_reference``."""
    if torch.jit.is_scripting():
        return t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, scale)
    return inner_mlp.choose("t5_swiglu_ttt", backend, q, q.shape[-1])(q, k, v, w1, w2, w3, scale)


@register_notrace_function  # device dispatch: a leaf for torch.fx
def mlp_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            scale: float, backend: Optional[str] = None) -> torch.Tensor:
    """DiT5 2-layer SiLU-MLP regression inner step + apply; see ``inner_mlp.naive.mlp_ttt_reference``."""
    if torch.jit.is_scripting():
        return mlp_ttt_reference(q, k, v, w1, w2, scale)
    return inner_mlp.choose("dit5_mlp_ttt", backend, q, q.shape[-1])(q, k, v, w1, w2, scale)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device
def key_instance_norm(k: torch.Tensor, eps: float = 1.0, backend: Optional[str] = None) -> torch.Tensor:
    """T5 / DiT5 key instance-norm of (B, N, C) tokens over N; see ``key_norm.naive``."""
    if torch.jit.is_scripting():
        return key_norm_reference(k, eps)
    return key_norm.choose("key_instance_norm", backend, k)(k, eps)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device
def residual_dwconv3x3(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       feat_size: Tuple[int, int], act: Optional[str] = None,
                       backend: Optional[str] = None) -> torch.Tensor:
    """``act(x + dwconv3x3(x))`` on (B, N = H W, C) channels-last tokens: depthwise weight (C, 1, 3, 3), bias (C,),
    zero padding, ``act`` None or "gelu" (exact); see ``dwconv.naive``.  torch: the aten conv, add and GELU;
    triton: one kernel forward, two backward (dx; dW / db partials reduced in fixed order)."""
    if torch.jit.is_scripting():
        return residual_dwconv_reference(x, weight, bias, feat_size, act)
    return dwconv.choose("residual_dwconv3x3", backend, x)(x, weight, bias, feat_size, act)


def vit3_qkv_ttt(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], w1: torch.Tensor,
                 w2: torch.Tensor, w3: torch.Tensor, feat_size: Tuple[int, int], heads: int, scale: float,
                 normalize_grad: bool = True, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                 backend: Optional[str] = None, recompute: bool = True) -> torch.Tensor:
    """ViT3 mixer core: qkv projection (+ optional RoPE on the SwiGLU q, k), both inner steps, concat.

    (B, N, C) -> (B, N, C + d).  The lean paths (``torch``, ``triton``) store ``x`` and small per-(batch, head)
    tensors for the backward and recompute the projection (``recompute=False``: they keep its output instead, one
    GEMM fewer per training step for 3.5 C more floats per token); ``torch_naive`` stores everything.
    """
    if torch.jit.is_scripting():
        return qkv_ttt_naive(x, weight, bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos, sin)
    return vit3_ttt.choose("vit3_qkv_ttt", backend, x, x.shape[-1] // heads)(
        x, weight, bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos, sin, recompute=recompute)


def vit3_variant_qkv_ttt(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], w1: torch.Tensor,
                         w2: Optional[torch.Tensor], w3: torch.Tensor, feat_size: Tuple[int, int], heads: int,
                         scale: float, normalize_grad: bool = True, cos: Optional[torch.Tensor] = None,
                         sin: Optional[torch.Tensor] = None, last_only: bool = False, lr: float = 1.0,
                         share_qk: bool = False, steps: int = 1, backend: Optional[str] = None) -> torch.Tensor:
    """ViT3 mixer core with the inner-loop variants of ``vit3_variant.naive`` (``w2=None``: one linear layer)."""
    if torch.jit.is_scripting():
        return variant_qkv_naive(x, weight, bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos, sin,
                                 last_only, lr, share_qk, steps)
    return vit3_variant.choose("vit3_variant_qkv_ttt", backend, x, x.shape[-1] // heads)(
        x, weight, bias, w1, w2, w3, feat_size, heads, scale, normalize_grad, cos, sin, last_only, lr, share_qk, steps)


def ttt_linear(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch=16, ln_residual=True, eps=1e-6,
               return_grad_norm=False, backend=None):
    """Causal TTT-Linear mini-batch scan; see ``ttt_linear.naive.ttt_linear_naive``.

    torch: recomputing backward (``ttt_linear.torch``); triton: the fused scan kernels; torch_naive: the plain
    per-mini-batch scan (``ttt_linear_naive``) under autograd.
    """
    inputs = (q, k, v, lr, tau, w0, b0, ln_w, ln_b)
    return _ttt_linear.choose("ttt_linear", backend, q, q.shape[-1], inputs, return_grad_norm)(
        *inputs, mini_batch, ln_residual, eps, return_grad_norm)


@register_notrace_function  # a leaf for torch.fx: dispatch inspects the device, the scan loops over mini-batches
def ttt_linear_bidir(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                     w0: torch.Tensor, b0: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, mini_batch: int = 16,
                     ln_residual: bool = True, rope_theta: Optional[float] = 10000.0, eps: float = 1e-6,
                     return_grad_norm: bool = False, backend: Optional[str] = None
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward + flipped TTT-Linear scans, summed (Vision-TTT Eq. 12); see ``ttt_linear.naive.ttt_linear_bidir_naive``.

    torch: both directions batched, recomputing backward; triton: both directions in one kernel launch;
    torch_naive: the plain per-mini-batch scan under autograd.  ``return_grad_norm=True`` runs a PyTorch scan.
    TorchScript compiles the chunked scan (``ttt_linear.chunked.ttt_linear_bidir_chunked``).
    """
    if torch.jit.is_scripting():
        return ttt_linear_bidir_chunked(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual, rope_theta,
                                        eps, return_grad_norm)
    inputs = (q, k, v, lr, tau, w0, b0, ln_w, ln_b)
    return _ttt_linear.choose("ttt_linear_bidir", backend, q, q.shape[-1], inputs, return_grad_norm)(
        *inputs, mini_batch, ln_residual, rope_theta, eps, return_grad_norm)


def last_layer_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, scale: float,
                   loss: str = "dot", steps: int = 1, backend: Optional[str] = None) -> torch.Tensor:
    """T5 / DiT5 variants V1 / V3: ``steps`` inner steps of a linear last layer on fixed features, applied to q;
    see ``inner_mlp.naive.last_layer_ttt_reference``."""
    return inner_mlp.choose("last_layer_ttt", backend, q, q.shape[-1])(q, k, v, w, scale, loss, steps)


def linear_attention_bidir(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, tau: torch.Tensor,
                           w0: torch.Tensor, b0: torch.Tensor, mini_batch: int = 16,
                           rope_theta: Optional[float] = 10000.0, backend: Optional[str] = None) -> torch.Tensor:
    """Plain linear-attention Vision-TTT scan in both directions, summed; see ``linear_attention.naive``.
    torch: the chunk-parallel form; triton: the Triton forward (custom op); torch_naive: the recurrent scan."""
    return la_bidir(linear_attention.choose("linear_attention", backend, q, q.shape[-1]), q, k, v, lr, tau, w0, b0,
                    mini_batch, rope_theta)


__all__ = ["last_layer_ttt", "linear_attention_bidir", "mlp_inner_update_reference", "BACKENDS", "BackendError", "available_ops", "get_op", "register_op", "resolve_backend",
           "set_backend", "use_backend",
           "swiglu_ttt", "dwconv_ttt", "vit3_qkv_ttt", "swiglu_ttt_reference", "dwconv_ttt_reference",
           "swiglu_ttt_torch", "dwconv_ttt_torch", "mlp_ttt", "mlp_ttt_reference", "mlp_ttt_torch", "t5_swiglu_ttt",
           "t5_swiglu_ttt_reference", "t5_swiglu_ttt_torch", "key_instance_norm", "key_norm_reference",
           "key_norm_torch", "residual_dwconv3x3", "ttt_linear", "ttt_linear_bidir", "ttt_linear_naive",
           "ttt_linear_bidir_naive",
           "inner_rope", "token_tau"]
