"""timm ViT / DeiT -> T5 (or T5+): every pretrained tensor inherited, only the TTT parameters new.

"Linearizing Vision Transformer with Test-Time Training" (arXiv 2605.02772): the patch embedding, position
embedding, q/k/v/o projections, norms, MLPs and head are copied exactly; only the TTT inner weights w1..w3 and the
q/k depthwise convs are newly initialised.  The class (and distillation) token and ``head_dist`` are dropped, the
head mean-pools as in the paper, and the class-token entry of ``pos_embed`` is removed (then resampled if another
``img_size`` is asked for).
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import nn

from ttt_zoo.models.t5 import T5

__all__ = ["linearize_vit"]


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

    _check_supported_vit(model)
    pe = model.patch_embed
    embed_dim = model.embed_dim
    blk0 = model.blocks[0]
    src_grid = tuple(int(g) for g in pe.grid_size)
    size = tuple(pe.img_size) if img_size is None else ((img_size, img_size) if isinstance(img_size, int)
                                                         else tuple(img_size))
    ref = model.pos_embed
    kwargs = dict(img_size=list(size), patch_size=pe.patch_size[0], in_chans=pe.proj.in_channels,
                  num_classes=model.num_classes, embed_dim=embed_dim, depth=len(model.blocks),
                  num_heads=blk0.attn.num_heads, mlp_ratio=blk0.mlp.fc1.out_features / embed_dim,
                  qkv_bias=blk0.attn.qkv.bias is not None, na_kernel=na_kernel)
    target = T5(**kwargs).to(device=ref.device, dtype=ref.dtype)
    # how to build it again by name (a run records it: its readers rebuild the model without the source)
    target.build_spec = {"model": "t5_plus_tiny" if na_kernel else "t5_tiny", "model_kwargs": kwargs}

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

