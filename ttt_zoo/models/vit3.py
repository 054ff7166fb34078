"""ViT3: a plain (non-hierarchical) vision transformer whose attention is the ViT3 TTT mixer.

"ViT3: Unlocking Test-Time Training in Vision" (arXiv 2512.01643).  No class token and no absolute position
embedding: each block starts with a residual depthwise-conv position encoding (CPE), and the head mean-pools.
Official keys are kept, so the authors' checkpoints load through :func:`checkpoint_filter_fn` unchanged.
"""

from typing import Any, Dict

import torch
from timm.models import generate_default_cfgs, register_model

from ttt_zoo.layers.mixer import set_inner_steps
from ._common import build_ttt_model, image_cfg, unwrap_checkpoint, validate_state_dict, with_hub_ids
from ._plain import PlainTTTViT

__all__ = ["ViT3", "VARIANTS", "VIT3_SIZES", "ONE_BLOCK_KWARGS"]

#: the ViT3 sizes (one table: the registered models below, their Table-2 variants and the hub read it)
VIT3_SIZES = {
    "tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=6),
    "small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
}
#: family -> the overrides that shrink its smallest model to one block (the same block code; the compile checks)
ONE_BLOCK_KWARGS = {"vit3": dict(depth=1)}

#: the ViTTT ablation trajectory of Liu et al., "Test-Time Training with KV Binding Is Secretly Linear Attention",
#: Table 2 (cumulative; top-1 of ViTTT-B on ImageNet in the paper: baseline 79.34%).  Variants 2, 4 and 5 do not
#: apply to ViTTT (no weight normalisation, no per-token learning rate, no momentum: the table's daggers).  Any of
#: these also takes the Table 1 options (``gradient_ascent``, ``share_qk``) through ``mixer_kwargs``.
VARIANTS = {
    "v1": dict(inner_update="last"),                                                   # row "Variant 1": 79.63%
    "v3": dict(inner_update="last", inner_model="linear"),                              # row "Variant 3": 79.39%
    "v6": dict(inner_update="last", inner_model="linear", normalize_grad=False),        # row "Variant 6": 79.54%
}


def variant_kwargs(variant: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` with the Table-2 variant's mixer options under ``mixer_kwargs`` (the caller's win)."""
    if kwargs.get("mixer", "vit3") != "vit3":
        raise ValueError(f"the {variant} variants are options of the 'vit3' mixer; got mixer={kwargs['mixer']!r}")
    return dict(kwargs, mixer_kwargs=dict(VARIANTS[variant], **(kwargs.get("mixer_kwargs") or {})))


class ViT3(PlainTTTViT):
    """Patch embedding -> TTT blocks (CPE, TTT mixer, MLP) -> LayerNorm -> mean pool -> head."""

    def __init__(self, num_heads: int = 6, mixer: str = "vit3", **kwargs):
        """Args: those of :class:`PlainTTTViT` (CPE on, no position embedding)."""
        super().__init__(num_heads=num_heads, mixer=mixer, cpe=True, pos_embed=False, **kwargs)

    @torch.jit.ignore
    def set_inner_steps(self, steps: int) -> None:
        """k inner steps on (k, v) in every mixer (Figure 1 of Liu et al., "TTT with KV Binding Is Secretly Linear
        Attention", varies it at inference)."""
        set_inner_steps(self, steps)


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: ViT3) -> Dict[str, torch.Tensor]:
    """Load official ViT3 checkpoints (``{'model': ...}`` from ``main.py``), ours, or a bare state dict."""
    sd = unwrap_checkpoint(state_dict)
    sd = {k: v for k, v in sd.items() if not k.startswith("head_dist.")}
    validate_state_dict(sd, model)
    return sd


def _create_vit3(variant: str, pretrained: bool = False, **kwargs) -> ViT3:
    return build_ttt_model(ViT3, variant, pretrained, default_out_indices=3,
                           pretrained_filter_fn=checkpoint_filter_fn, **kwargs)


#: the paper of ViT3 and H-ViT3, and where the authors' checkpoints are
VIT3_PAPER = dict(paper_ids="arXiv:2512.01643", paper_name="ViT3: Unlocking Test-Time Training in Vision",
                  origin_url="https://github.com/LeapLabTHU/ViTTT")
TSINGHUA_URL = "https://cloud.tsinghua.edu.cn/f/{}/?dl=1"


def _cfg(url: str = "", **kwargs) -> Dict[str, Any]:
    return image_cfg(url, pool_size=(14, 14), crop_pct=0.9, first_conv="patch_embed.proj", **VIT3_PAPER, **kwargs)


default_cfgs = generate_default_cfgs(with_hub_ids({
    "vit3_tiny.in1k": _cfg(url=TSINGHUA_URL.format("e12d1bd1c20c4e06a2da")),
    "vit3_small.in1k": _cfg(url=TSINGHUA_URL.format("4ab59ca54b474dff9b70")),
    "vit3_base.in1k": _cfg(url=TSINGHUA_URL.format("c9e9bb09f85d449ab8cf")),
    **{f"vit3_{size}_{v}": _cfg() for size in VIT3_SIZES for v in VARIANTS},
}))


@register_model
def vit3_tiny(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-T: 6.1M params, 1.2 GFLOPs, 76.5% top-1 (paper). Six heads of 32, unlike DeiT-T."""
    return _create_vit3("vit3_tiny", pretrained, **dict(VIT3_SIZES["tiny"], **kwargs))


@register_model
def vit3_small(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-S: 23.8M params, 4.8 GFLOPs, 81.6% top-1 (paper)."""
    return _create_vit3("vit3_small", pretrained, **dict(VIT3_SIZES["small"], **kwargs))


@register_model
def vit3_base(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-B: 90.1M params, 18.0 GFLOPs, 82.6% top-1 (paper)."""
    return _create_vit3("vit3_base", pretrained, **dict(VIT3_SIZES["base"], **kwargs))


# ---------------------------------------------------------------------------------- Table 2 (Liu et al.) variants
def _variant(size: str, v: str, pretrained: bool, kwargs: Dict[str, Any]) -> ViT3:
    return _create_vit3(f"vit3_{size}_{v}", pretrained, **dict(VIT3_SIZES[size], **variant_kwargs(v, kwargs)))


@register_model
def vit3_tiny_v1(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-T, Table 2 "Variant 1" (Liu et al.): only the last inner layer w1 updates; the gate w2 is static."""
    return _variant("tiny", "v1", pretrained, kwargs)


@register_model
def vit3_tiny_v3(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-T, Table 2 "Variant 3": V1 with a single linear inner layer (no w2): o = q (w1 - N(c k^T v))."""
    return _variant("tiny", "v3", pretrained, kwargs)


@register_model
def vit3_tiny_v6(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-T, Table 2 "Variant 6": V3 without gradient normalisation, plain linear attention o = q (w1 - c k^T v)."""
    return _variant("tiny", "v6", pretrained, kwargs)


@register_model
def vit3_small_v1(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-S, Table 2 "Variant 1": only the last inner layer w1 updates."""
    return _variant("small", "v1", pretrained, kwargs)


@register_model
def vit3_small_v3(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-S, Table 2 "Variant 3": a single linear inner layer."""
    return _variant("small", "v3", pretrained, kwargs)


@register_model
def vit3_small_v6(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-S, Table 2 "Variant 6": a single linear inner layer, no gradient normalisation."""
    return _variant("small", "v6", pretrained, kwargs)


@register_model
def vit3_base_v1(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-B, Table 2 "Variant 1": only the last inner layer w1 updates (79.63% vs 79.34% top-1 in the paper)."""
    return _variant("base", "v1", pretrained, kwargs)


@register_model
def vit3_base_v3(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-B, Table 2 "Variant 3": a single linear inner layer (79.39% top-1 in the paper)."""
    return _variant("base", "v3", pretrained, kwargs)


@register_model
def vit3_base_v6(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-B, Table 2 "Variant 6": a single linear inner layer, no gradient normalisation (79.54% in the paper)."""
    return _variant("base", "v6", pretrained, kwargs)
