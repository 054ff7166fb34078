"""DiT^3: the DiT skeleton with the ViT3 TTT mixer and a depthwise-conv CPE before each block.

"ViT3: Unlocking Test-Time Training in Vision" (arXiv 2512.01643), ``dittt/`` of the official code.  Official
keys (``blocks.i.{cpe,attn.{w1,w2,w3,qkv,proj},mlp,adaLN_modulation.1}``), so the released checkpoints
(``{'model', 'ema', 'opt', 'args'}``; the EMA weights are used, as the official sampler does) load through
:func:`ttt_zoo.models.dit.checkpoint_filter_fn`.
"""

from typing import Any, Dict

from timm.models import generate_default_cfgs, register_model

from ._common import with_hub_ids
from .dit import DiT, checkpoint_filter_fn, create_dit, dit_args, dit_cfg

__all__ = ["checkpoint_filter_fn", "ONE_BLOCK_KWARGS"]

#: family -> the overrides that shrink its smallest model to one block (sizes: ``dit.DIT_SIZES``; compile checks)
ONE_BLOCK_KWARGS = {"dit3": dict(depth=1)}

_TSINGHUA = "https://cloud.tsinghua.edu.cn/f/{}/?dl=1"


def _cfg(url: str = "", **kwargs) -> Dict[str, Any]:
    return dit_cfg(url=url, license="apache-2.0", paper_ids="arXiv:2512.01643",
                   paper_name="ViT3: Unlocking Test-Time Training in Vision",
                   origin_url="https://github.com/LeapLabTHU/ViTTT", **kwargs)


default_cfgs = generate_default_cfgs(with_hub_ids({
    # released 256px ImageNet models (retrained by the authors; FID-50K 39.44 / 65.25 / 120.82, README)
    "dit3_b_2.in1k_256": _cfg(url=_TSINGHUA.format("c68d33055c6b44f39584")),
    "dit3_b_4.in1k_256": _cfg(url=_TSINGHUA.format("49a2ea7a60624a8a94f3")),
    "dit3_b_8.in1k_256": _cfg(url=_TSINGHUA.format("d09682e5b50d40d48f4e")),
    "dit3_s_2": _cfg(), "dit3_s_4": _cfg(), "dit3_s_8": _cfg(),
    "dit3_l_2": _cfg(), "dit3_l_4": _cfg(), "dit3_l_8": _cfg(),
    "dit3_xl_2": _cfg(), "dit3_xl_4": _cfg(), "dit3_xl_8": _cfg(),
}))


def _dit3(size: str, patch: int, pretrained: bool, kwargs: Dict[str, Any]) -> DiT:
    args = dict(dit_args(size, patch), mixer="vit3", cpe=True)
    return create_dit(f"dit3_{size}_{patch}", pretrained, **dict(args, **kwargs))


@register_model
def dit3_s_2(pretrained: bool = False, **kwargs) -> DiT:
    """DiT3-S/2: 34,788,128 params (input_size 32, 1000 classes)."""
    return _dit3("s", 2, pretrained, kwargs)


@register_model
def dit3_s_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit3("s", 4, pretrained, kwargs)


@register_model
def dit3_s_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit3("s", 8, pretrained, kwargs)


@register_model
def dit3_b_2(pretrained: bool = False, **kwargs) -> DiT:
    """DiT3-B/2: 134,152,736 params; released 256px weights (FID 39.44)."""
    return _dit3("b", 2, pretrained, kwargs)


@register_model
def dit3_b_4(pretrained: bool = False, **kwargs) -> DiT:
    """DiT3-B/4: released 256px weights (FID 65.25)."""
    return _dit3("b", 4, pretrained, kwargs)


@register_model
def dit3_b_8(pretrained: bool = False, **kwargs) -> DiT:
    """DiT3-B/8: released 256px weights (FID 120.82)."""
    return _dit3("b", 8, pretrained, kwargs)


@register_model
def dit3_l_2(pretrained: bool = False, **kwargs) -> DiT:
    return _dit3("l", 2, pretrained, kwargs)


@register_model
def dit3_l_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit3("l", 4, pretrained, kwargs)


@register_model
def dit3_l_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit3("l", 8, pretrained, kwargs)


@register_model
def dit3_xl_2(pretrained: bool = False, **kwargs) -> DiT:
    return _dit3("xl", 2, pretrained, kwargs)


@register_model
def dit3_xl_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit3("xl", 4, pretrained, kwargs)


@register_model
def dit3_xl_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit3("xl", 8, pretrained, kwargs)
