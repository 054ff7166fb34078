"""T5: a ViT linearized with test-time training, and T5+ (TTT averaged with neighbourhood attention).

"Linearizing Vision Transformer with Test-Time Training" (T5 / DiT5, arXiv 2605.02772).  A plain ViT with a
learned absolute position embedding (no class token) whose softmax attention is the T5 TTT mixer; the head
mean-pools.  The position embedding is resampled for any input size the patch size allows, non-square included.
Official keys are kept (``Transformer-to-TTT/T5/models.py``).  Use :func:`ttt_zoo.linearize` to build one from a
pretrained timm ViT / DeiT.
"""

from typing import Any, Dict, Optional

import torch
from timm.models import generate_default_cfgs, register_model

from ttt_zoo.layers import family_mixer_kwargs
from ._common import build_ttt_model, image_cfg, unwrap_checkpoint, validate_state_dict
from ._plain import PlainTTTViT, fit_checkpoint_pos_embed, resample_pos_embed  # noqa: F401 (re-exported)

__all__ = ["T5", "resample_pos_embed", "T5_SIZES", "ONE_BLOCK_KWARGS"]

#: the T5 / T5+ sizes (DeiT-T and DeiT-S layouts; the official base is 512 wide, 24 deep)
T5_SIZES = {
    "tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "base": dict(patch_size=16, embed_dim=512, depth=24, num_heads=8),
}
#: family -> the overrides that shrink its smallest model to one block (the same block code; the compile checks)
ONE_BLOCK_KWARGS = {"t5": dict(depth=1), "t5_plus": dict(depth=1)}


class T5(PlainTTTViT):
    """Patch embedding + pos_embed -> TTT blocks (no CPE) -> LayerNorm -> mean pool -> head."""

    def __init__(self, num_heads: int = 3, patch_size: int = 16, na_kernel: int = 0, mixer: str = "t5",
                 mixer_kwargs: Optional[Dict[str, Any]] = None, **kwargs):
        """
        Args:
            na_kernel: 0 for T5; 5 (paper default) or 3 for T5+ (neighbourhood attention averaged in, Eq. 15),
                an option of the ``'t5'`` mixer.
            Others: those of :class:`PlainTTTViT` (position embedding, no CPE).
        """
        if na_kernel and mixer != "t5":
            raise ValueError(f"na_kernel={na_kernel} (T5+) is an option of the 't5' mixer, not of {mixer!r}; "
                             f"build t5_* (na_kernel=0) for another mixer.")
        mk = family_mixer_kwargs(mixer, "t5", dict(na_kernel=na_kernel), mixer_kwargs)
        super().__init__(num_heads=num_heads, patch_size=patch_size, mixer=mixer, mixer_kwargs=mk, cpe=False,
                         pos_embed=True, min_size=patch_size * max(na_kernel, 1), **kwargs)
        self.na_kernel = na_kernel


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: T5) -> Dict[str, torch.Tensor]:
    """Load official T5 checkpoints (``{'model', 'model_ema', ...}`` from ``T5/main.py``), ours, or a bare dict.

    The raw ``model`` entry is used (the official evaluation reports it); a ``pos_embed`` for another square grid
    (or with a leading class-token entry) is resampled to the model's grid.
    """
    if isinstance(state_dict, dict) and isinstance(state_dict.get("model"), dict):
        state_dict = state_dict["model"]
    sd = unwrap_checkpoint(state_dict)
    sd = {k: v for k, v in sd.items() if not k.startswith("head_dist.")}
    fit_checkpoint_pos_embed(sd, model)
    validate_state_dict(sd, model)
    return sd


def _create_t5(variant: str, pretrained: bool = False, **kwargs) -> T5:
    return build_ttt_model(T5, variant, pretrained, default_out_indices=3,
                           pretrained_filter_fn=checkpoint_filter_fn, **kwargs)


def _cfg(url: str = "", **kwargs) -> Dict[str, Any]:
    return image_cfg(url, pool_size=(14, 14), crop_pct=0.875, first_conv="patch_embed.proj",
                     paper_ids="arXiv:2605.02772", paper_name="Linearizing Vision Transformer with Test-Time Training",
                     origin_url="https://github.com/LeapLabTHU/Transformer-to-TTT", **kwargs)


# no trained T5 weights are released; build from a softmax ViT with ttt_zoo.linearize()
default_cfgs = generate_default_cfgs({
    "t5_tiny.untrained": _cfg(),
    "t5_small.untrained": _cfg(),
    "t5_base.untrained": _cfg(),
    "t5_plus_tiny.untrained": _cfg(),
    "t5_plus_small.untrained": _cfg(),
    "t5_plus_base.untrained": _cfg(),
})

@register_model
def t5_tiny(pretrained: bool = False, **kwargs) -> T5:
    """T5-T (DeiT-T layout): 6,205,480 params."""
    return _create_t5("t5_tiny", pretrained, **dict(T5_SIZES["tiny"], **kwargs))


@register_model
def t5_small(pretrained: bool = False, **kwargs) -> T5:
    """T5-S (DeiT-S layout): 23,026,792 params."""
    return _create_t5("t5_small", pretrained, **dict(T5_SIZES["small"], **kwargs))


@register_model
def t5_base(pretrained: bool = False, **kwargs) -> T5:
    """T5-B (official: 512 wide, 24 deep, 8 heads): 79,270,376 params."""
    return _create_t5("t5_base", pretrained, **dict(T5_SIZES["base"], **kwargs))


@register_model
def t5_plus_tiny(pretrained: bool = False, **kwargs) -> T5:
    """T5+-T: T5-T averaged with 5x5 neighbourhood attention (``na_kernel=3`` for NAT3); no extra params."""
    return _create_t5("t5_plus_tiny", pretrained, **dict(T5_SIZES["tiny"], na_kernel=5) | kwargs)


@register_model
def t5_plus_small(pretrained: bool = False, **kwargs) -> T5:
    """T5+-S: T5-S averaged with 5x5 neighbourhood attention (``na_kernel=3`` selectable)."""
    return _create_t5("t5_plus_small", pretrained, **dict(T5_SIZES["small"], na_kernel=5) | kwargs)


@register_model
def t5_plus_base(pretrained: bool = False, **kwargs) -> T5:
    """T5+-B: T5-B averaged with 5x5 neighbourhood attention (``na_kernel=3`` selectable)."""
    return _create_t5("t5_plus_base", pretrained, **dict(T5_SIZES["base"], na_kernel=5) | kwargs)
