"""DiT5: a softmax DiT linearised with test-time training (half TTT, half neighbourhood attention).

"Linearizing Vision Transformer with Test-Time Training" (arXiv 2605.02772), ``DiT5/models.py`` of the official
code: the DiT skeleton without CPE, with the ``dit5_mixed`` mixer.  :func:`linearize_dit` turns a softmax DiT
(``dit_*``, the original DiT key layout) into DiT5, copying every inherited tensor; :func:`dit5_param_groups`
gives the TTT inner weights the paper's 2x learning rate.  No trained DiT5 weights are released.
"""

from typing import Any, Dict, Iterable, List, Optional, Tuple

from torch import nn
from timm.models import generate_default_cfgs, register_model

from ttt_zoo.layers import DiT5MixedAttention, SoftmaxAttention
from .dit import DiT, create_dit, dit_args, dit_cfg

__all__ = ["linearize_dit", "dit5_param_groups", "DIT5_LR_MULTIPLIER"]

#: learning-rate multiplier of the TTT inner weights (DiT5/train.py ``--ttt-lr-scale``)
DIT5_LR_MULTIPLIER = 2.0


def linearize_dit(model: DiT, kernel_size: int = 5, dilation: int = 1) -> Tuple[DiT, List[str]]:
    """Convert a softmax DiT into DiT5, inheriting every tensor of ``model``.

    The DiT5 model has the same size, patch size, classes and latent size; every entry of ``model.state_dict()``
    (embedders, pos_embed, adaLN, qkv/proj, MLPs, final layer) is copied exactly.  Only the DiT5-specific mixer
    parameters are new, initialised as in the official code: ``w1``/``w2`` trunc-normal(.02), ``qk_scale_ttt`` 1,
    ``qk_offset_ttt`` 0, ``q_conv2d``/``k_conv2d`` PyTorch's default conv init.

    Returns:
        (dit5 model on the device/dtype of ``model``, in its train/eval mode; sorted names of the new parameters)
    """
    if not isinstance(model, DiT) or not all(isinstance(b.attn, SoftmaxAttention) for b in model.blocks):
        raise TypeError("linearize_dit expects a softmax DiT (a ttt_zoo DiT built with mixer='softmax', e.g. "
                        f"timm.create_model('dit_s_2')), got {type(model).__name__}"
                        + (f" with mixer {model.mixer!r}" if isinstance(model, DiT) else "") + ".")
    if any(b.cpe is not None for b in model.blocks):
        raise TypeError("linearize_dit expects a DiT without CPE (DiT5 blocks have none).")
    blk = model.blocks[0]
    ref = model.pos_embed
    new = DiT(input_size=model.grid_size[0] * model.patch_size, patch_size=model.patch_size, in_chans=model.in_chans,
              hidden_size=model.hidden_size, depth=len(model.blocks), num_heads=blk.attn.num_heads,
              mlp_ratio=blk.mlp.fc1.out_features / model.hidden_size,
              class_dropout_prob=model.y_embedder.dropout_prob, num_classes=model.num_classes,
              learn_sigma=model.learn_sigma, mixer="dit5_mixed",
              mixer_kwargs=dict(kernel_size=kernel_size, dilation=dilation))
    if model.grid_size[0] != model.grid_size[1]:
        raise ValueError(f"linearize_dit supports models built for square latents, got grid {model.grid_size}.")
    new = new.to(device=ref.device, dtype=ref.dtype)
    src = model.state_dict()
    missing, unexpected = new.load_state_dict(src, strict=False)
    if unexpected:
        raise RuntimeError(f"linearize_dit: source tensors with no place in DiT5: {unexpected[:5]}")
    new.train(model.training)
    arch = str((getattr(model, "pretrained_cfg", None) or {}).get("architecture", "dit"))
    new.pretrained_cfg = dict(dit5_cfg_for(arch))
    return new, sorted(missing)


def dit5_cfg_for(softmax_arch: str) -> Dict[str, Any]:
    """The dit5_* pretrained cfg matching a dit_* architecture name (a generic one for custom sizes)."""
    name = "dit5_" + softmax_arch[len("dit_"):] if softmax_arch.startswith("dit_") else ""
    cfg = default_cfgs[name].default.to_dict() if name in default_cfgs else _cfg()
    return dict(cfg, architecture=name or "dit5")


def dit5_param_groups(model: nn.Module, lr: float, multiplier: float = DIT5_LR_MULTIPLIER,
                      weight_decay: float = 0.0, names: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """Two AdamW parameter groups as in DiT5/train.py: the TTT inner weights (``attn.w1``, ``attn.w2``) at
    ``lr * multiplier`` (2x), everything else that trains at ``lr``.  ``names`` overrides the boosted set
    (e.g. the names returned by :func:`linearize_dit`); frozen parameters (``pos_embed``) are left out."""
    if names is None:
        names = {f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, DiT5MixedAttention)
                 for pn in m.inner_param_names}
    names = set(names)
    unknown = names - {n for n, _ in model.named_parameters()}
    if unknown:
        raise ValueError(f"dit5_param_groups: no such parameters in the model: {sorted(unknown)[:5]}")
    boosted, base = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (boosted if n in names else base).append(p)
    return [dict(params=base, lr=lr, weight_decay=weight_decay),
            dict(params=boosted, lr=lr * multiplier, weight_decay=weight_decay)]


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
