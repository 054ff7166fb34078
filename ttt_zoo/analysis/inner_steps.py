"""Inference-time inner steps (Figure 1 of "Test-Time Training with KV Binding Is Secretly Linear Attention").

The paper's Figure 1 runs more inner steps at inference: the inner loss on (k, v) keeps falling while accuracy
falls too, so the inner loop is not memorising (k, v).  :func:`vit3_inner_losses` gives the first axis for one ViT3
mixer, :func:`record_inner_losses` for every ViT3 mixer of a model during its forward passes.

    with record_inner_losses(model, steps=4) as losses:
        model(images)                 # losses[name]: (5,) mean inner loss before and after each of 4 steps
"""
from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

import torch
from torch import Tensor, nn

from ttt_zoo.kernels.vit3_variant.common import variant_qkv_split
from ttt_zoo.kernels.vit3_variant.naive import swiglu_inner_loss, swiglu_variant_steps
from ttt_zoo.layers.rope import rope_2d_tables
from ttt_zoo.layers.vit3_ttt import ViT3TTT

__all__ = ["vit3_inner_losses", "record_inner_losses"]


@torch.no_grad()
def vit3_inner_losses(mixer: ViT3TTT, x: Tensor, feat_size: Tuple[int, int], steps: int) -> Tensor:
    """The SwiGLU branch's inner loss -scale/N sum_n <f(k_n), v_n>, mean over batch and heads, before and after
    each of ``steps`` inner steps with the mixer's own options: a (steps + 1,) float tensor."""
    if not isinstance(mixer, ViT3TTT):
        raise TypeError(f"vit3_inner_losses takes a ViT3TTT mixer (ViT3 / H-ViT3 / DiT3), got {type(mixer).__name__}")
    cos = sin = None
    if mixer.use_rope:
        cos, sin = rope_2d_tables(feat_size, mixer.dim, mixer.rope_base, device=x.device)
    (_, k, v), _ = variant_qkv_split(x, mixer.qkv.weight, mixer.qkv.bias, feat_size, mixer.num_heads, cos, sin,
                                     mixer.share_qk)
    weights = swiglu_variant_steps(k, v, mixer.w1, mixer.w2, mixer.scale, mixer.normalize_grad,
                                   mixer.inner_update == "last", -1.0 if mixer.gradient_ascent else 1.0, steps)
    return torch.stack([swiglu_inner_loss(k, v, w1, w2, mixer.scale).mean() for w1, w2 in weights]).float()


@contextmanager
def record_inner_losses(model: nn.Module, steps: int) -> Iterator[Dict[str, List[Tensor]]]:
    """While active, every forward of a ViT3 mixer appends its :func:`vit3_inner_losses` curve (``steps`` steps)
    to ``losses[module name]``."""
    losses: Dict[str, List[Tensor]] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, ViT3TTT):
            def hook(mod, args, name=name):
                x, feat_size = args[0], args[1]
                losses.setdefault(name, []).append(vit3_inner_losses(mod, x, tuple(feat_size), steps))
            handles.append(m.register_forward_pre_hook(hook))
    if not handles:
        raise ValueError(f"{type(model).__name__} has no ViT3 mixer: inner losses apply to ViT3 / H-ViT3 / DiT3")
    try:
        yield losses
    finally:
        for h in handles:
            h.remove()
