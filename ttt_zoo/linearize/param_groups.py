"""Optimizer parameter groups in which the newly initialised TTT parameters carry a larger ``lr_scale``."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence

from torch import nn

from ttt_zoo.layers import DiT5MixedAttention
from .lr_scales import LR_SCALES, model_family

__all__ = ["param_groups", "sd3_param_groups", "dit5_param_groups"]


def param_groups(model: nn.Module, new_param_names: Iterable[str], lr: Optional[float] = None,
                 multiplier: Optional[float] = None, weight_decay: float = 0.05, no_weight_decay: Sequence[str] = (),
                 layer_decay: Optional[float] = None, layer_decay_min_scale: float = 0.0) -> List[Dict[str, Any]]:
    """Optimizer parameter groups in which the newly initialised parameters carry ``lr_scale = multiplier``.

    The groups are timm's: decay / no-decay (``param_groups_weight_decay``: 1-D tensors, biases and names in
    ``model.no_weight_decay()`` / ``no_weight_decay`` get none) or, with ``layer_decay``, timm's layer-decay groups
    (``param_groups_layer_decay`` through ``model.group_matcher()``); each is split into inherited and new
    parameters, and the new ones' ``lr_scale`` is multiplied by ``multiplier``.  ``multiplier`` defaults to the
    model family's entry of :data:`LR_SCALES` (20x classification, 2x DiT, 1x SD3).

    ``lr_scale`` is a relative factor: timm's schedulers set each group's lr to ``schedule(t) * lr_scale`` at every
    step, so warmup, ``warmup_lr`` and ``min_lr`` all keep the ratio (an absolute ``lr`` per group would be floored
    by ``min_lr`` / ``warmup_lr``).  ``lr`` (optional) is stored as every group's base lr.  Without a timm scheduler
    apply the scale yourself: ``g["lr"] = lr * g.get("lr_scale", 1.0)``.
    Frozen parameters (``requires_grad=False``) are left out; empty groups are omitted.
    """
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay
    if multiplier is None:
        multiplier = LR_SCALES[model_family(model)]
    named = dict(model.named_parameters())
    new = set(new_param_names)
    unknown = sorted(new - set(named))
    if unknown:
        raise ValueError(f"new_param_names not in the model: {unknown[:6]} (pass the names returned by linearize()).")
    skip = set(no_weight_decay) | set(getattr(model, "no_weight_decay", lambda: ())())
    if layer_decay is not None:
        base = param_groups_layer_decay(model, weight_decay=weight_decay, no_weight_decay_list=skip,
                                        layer_decay=layer_decay, min_scale=layer_decay_min_scale)
    else:
        base = param_groups_weight_decay(model, weight_decay=weight_decay, no_weight_decay_list=skip)
    new_ids = {id(named[n]) for n in new}
    out = []
    for i, g in enumerate(base):
        decay = "decay" if g["weight_decay"] else "no_decay"
        layer = f"layer{i}_" if layer_decay is not None else ""
        for is_new in (False, True):
            params = [p for p in g["params"] if (id(p) in new_ids) == is_new]
            if not params:
                continue
            group = dict(g, params=params, lr_scale=g.get("lr_scale", 1.0) * (multiplier if is_new else 1.0),
                         name=("new_" if is_new else "") + layer + decay)
            if lr is not None:
                group["lr"] = lr
            out.append(group)
    return out


def sd3_param_groups(model: nn.Module, new_param_names: Optional[Iterable[str]] = None,
                     lr_scale: float = LR_SCALES["sd3"], weight_decay: float = 1e-4) -> List[Dict[str, Any]]:
    """:func:`param_groups` for SD3.5-T5: the new TTT parameters (default: ``model.new_parameter_names()``) carry
    ``lr_scale`` (relative to the trainer's lr), the inherited ones 1.  Biases, 1-D tensors and the per-channel
    ``qk_scale`` / ``qk_offset`` get no weight decay; frozen parameters are left out."""
    names = list(model.new_parameter_names() if new_param_names is None else new_param_names)
    affine = [n for n, _ in model.named_parameters() if n.endswith((".ttt.qk_scale", ".ttt.qk_offset"))]
    return param_groups(model, names, multiplier=lr_scale, weight_decay=weight_decay, no_weight_decay=affine)


def dit5_param_groups(model: nn.Module, lr: float, multiplier: float = LR_SCALES["dit"],
                      weight_decay: float = 0.0, names: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """:func:`param_groups` in the form of the official DiT5/train.py: two AdamW groups with absolute lrs, every
    trained parameter at ``lr`` except the TTT inner weights (``attn.w1``, ``attn.w2``) at ``lr * multiplier``
    (2x), one ``weight_decay`` for all.  ``names`` overrides the boosted set (e.g. the names returned by
    ``linearize``); frozen parameters (``pos_embed``) are left out."""
    if names is None:
        names = [f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, DiT5MixedAttention)
                 for pn in m.inner_param_names]
    groups = param_groups(model, names, multiplier=multiplier, weight_decay=weight_decay)
    boosted_ids = {id(p) for g in groups if g["name"].startswith("new_") for p in g["params"]}
    trained = [p for p in model.parameters() if p.requires_grad]
    return [dict(params=[p for p in trained if id(p) not in boosted_ids], lr=lr, weight_decay=weight_decay),
            dict(params=[p for p in trained if id(p) in boosted_ids], lr=lr * multiplier, weight_decay=weight_decay)]
