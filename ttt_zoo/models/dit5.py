"""DiT5: a softmax DiT linearised with test-time training (half TTT, half neighbourhood attention).

"Linearizing Vision Transformer with Test-Time Training" (arXiv 2605.02772), ``DiT5/models.py`` of the official
code: the DiT skeleton without CPE, with the ``dit5_mixed`` mixer.  No trained DiT5 weights are released:
``ttt_zoo.linearize`` turns a softmax DiT (``dit_*``, the original DiT key layout) into DiT5, copying every inherited
tensor; ``ttt_zoo.param_groups`` gives the TTT inner weights the paper's 2x learning rate.
"""

from typing import Any, Dict

from timm.models import generate_default_cfgs, register_model

from .dit import DiT, create_dit, dit_args, dit_cfg

__all__ = ["dit5_cfg_for", "ONE_BLOCK_KWARGS"]

#: family -> the overrides that shrink its smallest model to one block (sizes: ``dit.DIT_SIZES``; compile checks)
ONE_BLOCK_KWARGS = {"dit5": dict(depth=1)}


def dit5_cfg_for(softmax_arch: str) -> Dict[str, Any]:
    """The dit5_* pretrained cfg matching a dit_* architecture name (a generic one for custom sizes)."""
    name = "dit5_" + softmax_arch[len("dit_"):] if softmax_arch.startswith("dit_") else ""
    cfg = default_cfgs[name].default.to_dict() if name in default_cfgs else _cfg()
    return dict(cfg, architecture=name or "dit5")


def _cfg(**kwargs) -> Dict[str, Any]:
    return dit_cfg(license="apache-2.0", paper_ids="arXiv:2605.02772",
                   paper_name="Linearizing Vision Transformer with Test-Time Training",
                   origin_url="https://github.com/LeapLabTHU/Transformer-to-TTT", **kwargs)


default_cfgs = generate_default_cfgs({
    f"dit5_{s}_{p}": _cfg() for s in ("s", "b", "l", "xl") for p in (2, 4, 8)})


def _dit5(size: str, patch: int, pretrained: bool, kwargs: Dict[str, Any]) -> DiT:
    args = dict(dit_args(size, patch), mixer="dit5_mixed", cpe=False)
    return create_dit(f"dit5_{size}_{patch}", pretrained, **dict(args, **kwargs))


@register_model
def dit5_s_2(pretrained: bool = False, **kwargs) -> DiT:
    """DiT5-S/2: 33,663,776 params (input_size 32, 1000 classes); the paper's linearised DiT-S/2."""
    return _dit5("s", 2, pretrained, kwargs)


@register_model
def dit5_s_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("s", 4, pretrained, kwargs)


@register_model
def dit5_s_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("s", 8, pretrained, kwargs)


@register_model
def dit5_b_2(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("b", 2, pretrained, kwargs)


@register_model
def dit5_b_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("b", 4, pretrained, kwargs)


@register_model
def dit5_b_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("b", 8, pretrained, kwargs)


@register_model
def dit5_l_2(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("l", 2, pretrained, kwargs)


@register_model
def dit5_l_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("l", 4, pretrained, kwargs)


@register_model
def dit5_l_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("l", 8, pretrained, kwargs)


@register_model
def dit5_xl_2(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("xl", 2, pretrained, kwargs)


@register_model
def dit5_xl_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("xl", 4, pretrained, kwargs)


@register_model
def dit5_xl_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit5("xl", 8, pretrained, kwargs)
