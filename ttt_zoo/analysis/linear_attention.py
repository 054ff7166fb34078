"""Every TTT mixer as the linear attention it secretly is ("Test-Time Training with KV Binding Is Secretly Linear
Attention", Theorems 5.1-5.3, Appendices F-H).

Each mixer class builds its own exact form beside its forward (``mixer.linear_attention_form(x, feat_size)``, in
two stages ``linear_attention_inputs`` -> ``linear_attention_form_from_inputs``); a mixer without one (softmax
attention) raises a one-line ``NotImplementedError`` saying so.  This module only forwards to those methods, so it
names no mixer.  ``form.output()`` recomputes the mixer's output from the form alone (the dynamic parts, e.g. ViT3's
gate W2' after its own step, come from autograd of the inner loss).  The forms (:mod:`ttt_zoo.layers.la_forms`):

- :class:`SwiGLUForm` (ViT3 SwiGLU heads; W1 is the last layer): ``o = gate * (q S)``, ``S = w1 + sum_t k^T v_hat_t``,
  ``v_hat_t = lr (s/N) v * silu(k w2_t) / c_t`` (c_t the per-column normaliser, 1 without ``normalize_grad``; one key
  block per inner step), ``gate = silu(q w2')`` (w2 stepped; w2 itself for V1; 1 for the linear inner model V3).
- :class:`PatchForm` (ViT3 3x3 depthwise-conv head): per channel a linear attention over all tokens whose
  queries/keys are the zero-padded 3x3 patches, ``v_hat = steps lr (s/N) v / c``, ``S0 = w3``.
- :class:`KernelForm` (T5: ``q_hat = silu(q W1') * (q W2')``, ``k_hat = silu(k w1) * (k w2)``, ``v_hat = (s/N) v``,
  ``S0 = w3``; DiT5: ``q_hat = silu(q W1')``, ``k_hat = silu(k w1)``, ``v_hat = (s/N)(v - f0(k))``, ``S0 = w2``; V1 keeps
  the hidden weights, V3 has none; one key block per inner step), on the key-normed, DWC-enhanced q, k.
- :class:`ScanForm` (Vision-TTT, one scan direction): ``q_hat = [q, 1]``, ``k_hat = [k, 1]``, ``v'_j = -lr_j g_j``
  (g_j the inner gradient at the state entering j's mini-batch; ``-v_j`` for the dot loss of ``visionttt_*_la``),
  mask weights ``tau_{pos i}`` inside a mini-batch (inclusive) and ``tau_{b-1}`` for earlier ones.

:class:`ViT3Form`, :class:`T5Form`, :class:`VisionTTTForm` add what surrounds the core: ``form.core()`` is the token
mixing before the output-side per-token transforms, ``form.output()`` the mixer output.
"""
from typing import Dict, Tuple

from torch import Tensor

from ttt_zoo.layers.la_forms import (KernelForm, PatchForm, ScanForm, SwiGLUForm, T5Form, ViT3Form,  # noqa: F401
                                     VisionTTTForm)

__all__ = ["SwiGLUForm", "PatchForm", "KernelForm", "ScanForm", "ViT3Form", "T5Form", "VisionTTTForm",
           "linear_attention", "mixer_inputs", "form_from_inputs", "has_linear_attention_form"]


def has_linear_attention_form(mixer) -> bool:
    """Whether ``mixer`` (with its options) declares an exact form (else calling it raises NotImplementedError)."""
    return mixer.linear_attention_unsupported() is None


def mixer_inputs(mixer, x: Tensor, feat_size: Tuple[int, int]) -> Dict[str, Tensor]:
    """Stage 1, the projections (``mixer.linear_attention_inputs``): q, k, v (B, N, channels) in token order;
    ``v`` is the value every attention map is taken against."""
    mixer._no_form_message(check=True)
    return mixer.linear_attention_inputs(x, (int(feat_size[0]), int(feat_size[1])))


def form_from_inputs(mixer, inputs: Dict[str, Tensor], feat_size: Tuple[int, int]):
    """Stage 2: the form from :func:`mixer_inputs` (differentiable in them)."""
    mixer._no_form_message(check=True)
    return mixer.linear_attention_form_from_inputs(inputs, (int(feat_size[0]), int(feat_size[1])))


def linear_attention(mixer, x: Tensor, feat_size: Tuple[int, int]):
    """The exact linear-attention form of ``mixer`` on tokens ``x`` (B, N, C) of a ``feat_size`` = (H, W) map
    (``mixer.linear_attention_form``); ``form.output()`` equals ``mixer(x, feat_size)`` (to rounding; eval mode)."""
    return mixer.linear_attention_form(x, feat_size)
