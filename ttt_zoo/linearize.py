"""Turn a pretrained softmax transformer into its TTT counterpart by inheriting every weight (T5 / DiT5).

"Linearizing Vision Transformer with Test-Time Training" (arXiv 2605.02772): all original parameters (patch
embedding, position embedding, q/k/v/o projections, norms, MLPs, head) are copied exactly; only the TTT-specific
parameters (inner weights w1..w3 and the q/k depthwise convs) are newly initialised, and are trained with a larger
learning rate (20x for classification, 2x for diffusion; see :func:`param_groups`).

timm ``VisionTransformer`` / DeiT (with or without class token) -> :class:`ttt_zoo.models.T5`: the class (and
distillation) token and ``head_dist`` are dropped, the head mean-pools as in the paper, and the class-token entry
of ``pos_embed`` is removed (then resampled if another ``img_size`` is asked for).
A softmax DiT -> DiT5 through ``ttt_zoo.models.dit5.linearize_dit`` (imported lazily).
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

__all__ = ["linearize", "linearize_vit", "param_groups", "CLASSIFICATION_LR_MULTIPLIER", "DIFFUSION_LR_MULTIPLIER"]

CLASSIFICATION_LR_MULTIPLIER = 20.0
DIFFUSION_LR_MULTIPLIER = 2.0


def _is_dit(model: nn.Module) -> bool:
    return hasattr(model, "x_embedder") and hasattr(model, "t_embedder")


def linearize(model: nn.Module, **kwargs) -> Tuple[nn.Module, List[str]]:
    """Convert a softmax ViT / DeiT into T5 (or a softmax DiT into DiT5).

    Returns ``(converted_model, new_param_names)``: the names of the only parameters that were newly initialised.
    Keyword arguments go to the family's converter (:func:`linearize_vit`: ``na_kernel``, ``img_size``).
    """
    if _is_dit(model):
        try:
            dit5 = importlib.import_module("ttt_zoo.models.dit5")
        except ModuleNotFoundError as e:
            if e.name not in ("ttt_zoo.models.dit5", "ttt_zoo.models"):
                raise
            raise NotImplementedError(
                f"{type(model).__name__} looks like a DiT, but DiT5 conversion (ttt_zoo.models.dit5.linearize_dit) "
                f"is not available in this installation.") from e
        return dit5.linearize_dit(model, **kwargs)
    from timm.models.vision_transformer import VisionTransformer
    if isinstance(model, VisionTransformer):
        return linearize_vit(model, **kwargs)
    raise TypeError(f"linearize() converts timm VisionTransformer / DeiT models (to T5) and softmax DiT models "
                    f"(to DiT5); got {type(model).__name__}.")


def _check_supported_vit(model: nn.Module) -> None:
    """Raise for ViT options that have no T5 counterpart and would not show up as extra/missing tensors."""
    from timm.layers import Mlp, PatchEmbed
    from timm.models.vision_transformer import Attention, Block
    problems = []
    if not isinstance(model.patch_embed, PatchEmbed):
        problems.append(f"patch embedding {type(model.patch_embed).__name__} (need timm PatchEmbed)")
    else:
        ps = model.patch_embed.patch_size
        if ps[0] != ps[1]:
            problems.append(f"non-square patches {tuple(ps)}")
        if not isinstance(model.patch_embed.norm, nn.Identity):
            problems.append("a norm in the patch embedding (embed_norm_layer)")
    if getattr(model, "pos_embed", None) is None:
        problems.append("no learned pos_embed (pos_embed='learn' is required)")
    if getattr(model, "num_reg_tokens", 0):
        problems.append(f"{model.num_reg_tokens} register tokens")
    if getattr(model, "attn_pool", None) is not None:
        problems.append("attention pooling (global_pool='map')")
    if not isinstance(getattr(model, "fc_norm", nn.Identity()), nn.Identity):
        problems.append("fc_norm (a norm after pooling; T5 normalises tokens before mean pooling): "
                        "build the ViT with fc_norm=False")
    if not isinstance(getattr(model, "norm_pre", nn.Identity()), nn.Identity):
        problems.append("a pre-norm before the blocks (pre_norm=True)")
    norms = [model.norm] if isinstance(getattr(model, "fc_norm", nn.Identity()), nn.Identity) else []
    for i, blk in enumerate(model.blocks):
        if type(blk) is not Block:
            problems.append(f"blocks.{i} is {type(blk).__name__} (need timm's Block)")
            continue
        if not isinstance(blk.attn, Attention) or getattr(blk.attn, "gate", None) is not None:
            problems.append(f"blocks.{i}.attn is not plain timm Attention")
        elif not isinstance(blk.attn.q_norm, nn.Identity) or not isinstance(blk.attn.norm, nn.Identity):
            problems.append(f"blocks.{i}.attn has q/k or output norms (qk_norm / scale_attn_norm)")
        if not isinstance(blk.ls1, nn.Identity) or not isinstance(blk.ls2, nn.Identity):
            problems.append(f"blocks.{i} has layer scale (init_values)")
        if type(blk.mlp) is not Mlp or not isinstance(blk.mlp.norm, nn.Identity):
            problems.append(f"blocks.{i}.mlp is not a plain timm Mlp")
        elif not (isinstance(blk.mlp.act, nn.GELU) and blk.mlp.act.approximate == "none"):
            problems.append(f"blocks.{i}.mlp activation is {blk.mlp.act} (T5 uses exact GELU)")
        norms += [blk.norm1, blk.norm2]
    for nm in norms:
        if not isinstance(nm, nn.LayerNorm) or abs(nm.eps - 1e-6) > 1e-12:
            problems.append(f"norm {nm} (T5 uses LayerNorm with eps 1e-6)")
            break
    if problems:
        raise ValueError(f"Cannot linearize this {type(model).__name__} into T5: " + "; ".join(problems) + ".")


def linearize_vit(model: nn.Module, na_kernel: int = 0,
                  img_size: Optional[Union[int, Tuple[int, int]]] = None) -> Tuple[nn.Module, List[str]]:
    """timm ViT / DeiT -> :class:`ttt_zoo.models.T5` (``na_kernel=5`` or ``3`` gives T5+).

    ``img_size`` (default: the source's) sets the converted model's native grid; the position embedding is
    resampled to it.  The result has the source's dtype, device and train/eval mode.
    """
    from timm.layers import resample_abs_pos_embed
    from ttt_zoo.models.t5 import T5

    _check_supported_vit(model)
    pe = model.patch_embed
    embed_dim = model.embed_dim
    blk0 = model.blocks[0]
    src_grid = tuple(int(g) for g in pe.grid_size)
    size = tuple(pe.img_size) if img_size is None else ((img_size, img_size) if isinstance(img_size, int)
                                                         else tuple(img_size))
    ref = model.pos_embed
    target = T5(img_size=size, patch_size=pe.patch_size[0], in_chans=pe.proj.in_channels,
                num_classes=model.num_classes, embed_dim=embed_dim, depth=len(model.blocks),
                num_heads=blk0.attn.num_heads, mlp_ratio=blk0.mlp.fc1.out_features / embed_dim,
                qkv_bias=blk0.attn.qkv.bias is not None, na_kernel=na_kernel).to(device=ref.device, dtype=ref.dtype)

    # source tensors under T5 names
    src = dict(model.state_dict())
    dropped = [k for k in src if k in ("cls_token", "dist_token", "reg_token") or k.startswith("head_dist.")]
    for k in dropped:
        src.pop(k)
    pos = src["pos_embed"]
    if not model.no_embed_class:
        pos = pos[:, model.num_prefix_tokens:]
    if pos.shape[1] != src_grid[0] * src_grid[1]:
        raise ValueError(f"pos_embed has {pos.shape[1]} patch entries but the patch grid is {src_grid}.")
    if tuple(target.grid_size) != src_grid:
        pos = resample_abs_pos_embed(pos, new_size=list(target.grid_size), old_size=list(src_grid),
                                     num_prefix_tokens=0)
    src["pos_embed"] = pos

    new_names = [f"blocks.{i}.attn.{n}" for i, blk in enumerate(target.blocks) for n, _ in blk.attn.ttt_parameters()]
    own = target.state_dict()
    inherited = [k for k in own if k not in set(new_names)]
    missing = [k for k in inherited if k not in src]
    unexpected = [k for k in src if k not in own]
    mismatched = [f"{k}: {tuple(src[k].shape)} vs {tuple(own[k].shape)}" for k in inherited
                  if k in src and src[k].shape != own[k].shape]
    if missing or unexpected or mismatched:
        raise ValueError(f"Cannot linearize this {type(model).__name__} into T5: tensors without a T5 counterpart "
                         f"{unexpected[:6]}, T5 tensors the source lacks {missing[:6]}, shape mismatches "
                         f"{mismatched[:6]}.")
    with torch.no_grad():
        for k in inherited:
            own[k].copy_(src[k])
    target.train(model.training)
    return target, new_names


def param_groups(model: nn.Module, new_param_names: Iterable[str], lr: Optional[float] = None,
                 multiplier: Optional[float] = None, weight_decay: float = 0.05, no_weight_decay: Sequence[str] = (),
                 layer_decay: Optional[float] = None, layer_decay_min_scale: float = 0.0) -> List[Dict[str, Any]]:
    """Optimizer parameter groups in which the newly initialised parameters carry ``lr_scale = multiplier``.

    The groups are timm's: decay / no-decay (``param_groups_weight_decay``: 1-D tensors, biases and names in
    ``model.no_weight_decay()`` / ``no_weight_decay`` get none) or, with ``layer_decay``, timm's layer-decay groups
    (``param_groups_layer_decay`` through ``model.group_matcher()``); each is split into inherited and new
    parameters, and the new ones' ``lr_scale`` is multiplied by ``multiplier``.  ``multiplier`` defaults to the
    paper's 20x for classification and 2x for diffusion (DiT) models.

    ``lr_scale`` is a relative factor: timm's schedulers set each group's lr to ``schedule(t) * lr_scale`` at every
    step, so warmup, ``warmup_lr`` and ``min_lr`` all keep the ratio (an absolute ``lr`` per group would be floored
    by ``min_lr`` / ``warmup_lr``).  ``lr`` (optional) is stored as every group's base lr.  Without a timm scheduler
    apply the scale yourself: ``g["lr"] = lr * g.get("lr_scale", 1.0)``.
    Frozen parameters (``requires_grad=False``) are left out; empty groups are omitted.
    """
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay
    if multiplier is None:
        multiplier = DIFFUSION_LR_MULTIPLIER if _is_dit(model) else CLASSIFICATION_LR_MULTIPLIER
    named = dict(model.named_parameters())
    new = set(new_param_names)
    unknown = sorted(new - set(named))
    if unknown:
        raise KeyError(f"new_param_names not in the model: {unknown[:6]} (pass the names returned by linearize()).")
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
