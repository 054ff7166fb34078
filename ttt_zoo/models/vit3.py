"""ViT3: a plain (non-hierarchical) vision transformer whose attention is the ViT3 TTT mixer.

"ViT3: Unlocking Test-Time Training in Vision" (arXiv 2512.01643).  No class token and no absolute position
embedding: each block starts with a residual depthwise-conv position encoding (CPE), and the head mean-pools.
Official keys are kept, so the authors' checkpoints load through :func:`checkpoint_filter_fn` unchanged.
"""

from typing import Any, Dict

import torch
from timm.models import generate_default_cfgs, register_model

from ._common import build_ttt_model, image_cfg, unwrap_checkpoint, validate_state_dict, with_hub_ids
from ._plain import PlainTTTViT

__all__ = ["ViT3"]


class ViT3(PlainTTTViT):
    """Patch embedding -> TTT blocks (CPE, TTT mixer, MLP) -> LayerNorm -> mean pool -> head."""

    def __init__(self, num_heads: int = 6, mixer: str = "vit3", **kwargs):
        """Args: those of :class:`PlainTTTViT` (CPE on, no position embedding)."""
        super().__init__(num_heads=num_heads, mixer=mixer, cpe=True, pos_embed=False, **kwargs)


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
}))


@register_model
def vit3_tiny(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-T: 6.1M params, 1.2 GFLOPs, 76.5% top-1 (paper). Six heads of 32, unlike DeiT-T."""
    args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=6)
    return _create_vit3("vit3_tiny", pretrained, **dict(args, **kwargs))


@register_model
def vit3_small(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-S: 23.8M params, 4.8 GFLOPs, 81.6% top-1 (paper)."""
    args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_vit3("vit3_small", pretrained, **dict(args, **kwargs))


@register_model
def vit3_base(pretrained: bool = False, **kwargs) -> ViT3:
    """ViT3-B: 90.1M params, 18.0 GFLOPs, 82.6% top-1 (paper)."""
    args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_vit3("vit3_base", pretrained, **dict(args, **kwargs))
