"""Dense-prediction backbones for detection and segmentation (plain PyTorch; registered with mmdet/mmseg by
``ttt_zoo.adapters.mmdet`` / ``ttt_zoo.adapters.mmseg``).

- :class:`HViT3Dense`: the official det/seg H-ViT3 (``norm0..norm3`` on stage outputs at strides 4/8/16/32),
  plus frozen stages, gradient checkpointing and safe ``init_cfg`` loading.
- :class:`TimmDense`: any ttt_zoo timm model.  Hierarchical models give their stage outputs (each with a
  LayerNorm ``norms.i``); plain models (one stride) go through a ViTDet-style :class:`SimplePyramid` that makes
  4 levels at strides patch/4 .. patch*2.

Weights load only through safetensors or ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn
from timm.layers import LayerNorm2d

from ttt_zoo.checkpoint import (CheckpointError, load_checkpoint_file, mmengine_backbone, unwrap_checkpoint,
                                validate_state_dict)
from ttt_zoo.models.hvit3 import HVIT3_SIZES, HViT3Backbone, backbone_filter_fn  # the official sizes (spec §7)

__all__ = ["HViT3Dense", "TimmDense", "SimplePyramid"]

def _pretrained_path(init_cfg: Optional[Dict[str, Any]]) -> Optional[str]:
    if init_cfg is None:
        return None
    if not isinstance(init_cfg, dict) or init_cfg.get("type") != "Pretrained" or "checkpoint" not in init_cfg:
        raise ValueError(f"init_cfg must be None or dict(type='Pretrained', checkpoint=<path>), got {init_cfg!r}.")
    path = init_cfg["checkpoint"]
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise CheckpointError(
            f"Backbone checkpoint {path!r} not found. Set init_cfg=dict(type='Pretrained', checkpoint=<file>) to an "
            f"existing classification (.pth/.safetensors) or det/seg checkpoint.")
    return path


def _set_requires_grad(module: nn.Module, flag: bool) -> None:
    for p in module.parameters():
        p.requires_grad = flag


class _FreezeMixin:
    """``frozen_stages`` / ``norm_eval`` handling shared by the dense backbones (mmdet conventions)."""

    frozen_stages: int
    norm_eval: bool

    def _frozen_modules(self) -> List[nn.Module]:
        raise NotImplementedError

    def _freeze(self) -> None:
        for m in self._frozen_modules():
            m.eval()
            _set_requires_grad(m, False)

    def train(self, mode: bool = True):
        super().train(mode)  # type: ignore[misc]
        self._freeze()
        if mode and self.norm_eval:
            for m in self.modules():  # type: ignore[attr-defined]
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self


class HViT3Dense(_FreezeMixin, HViT3Backbone):
    """H-ViT3 det/seg backbone with the official state-dict layout (released det/seg checkpoints load as-is).

    Args:
        arch: 'tiny' | 'small' | 'base' (official dims/depths); ``embed_dim``/``depths`` override it.
        frozen_stages: -1 trains everything; 0 freezes the stem; k >= 1 also freezes stages 0..k-1 (blocks,
            their downsampling and their output norm), as in mmdet's Swin.
        norm_eval: keep the BatchNorms of the stem and merging layers in eval mode.
        use_checkpoint / with_cp: gradient checkpointing of every TTT block (official / mmdet name).
        init_cfg: ``dict(type='Pretrained', checkpoint=path)``: an H-ViT3 classification checkpoint (official
            ``{'model': ...}`` or ours), or a det/seg checkpoint (mmengine ``{'state_dict': {'backbone.*'}}``).
        prefer_ema: for classification checkpoints holding both, take ``state_dict_ema`` instead of ``model``
            (the official det/seg code takes ``model``).
    """

    def __init__(self, arch: str = "tiny", embed_dim: Optional[Sequence[int]] = None,
                 depths: Optional[Sequence[int]] = None, in_chans: int = 3, mlp_ratio: float = 4.0,
                 drop_path_rate: float = 0.1, out_indices: Sequence[int] = (0, 1, 2, 3), frozen_stages: int = -1,
                 norm_eval: bool = False, use_checkpoint: bool = False, with_cp: bool = False,
                 init_cfg: Optional[Dict[str, Any]] = None, prefer_ema: bool = False):
        if arch not in HVIT3_SIZES:
            raise ValueError(f"arch must be one of {sorted(HVIT3_SIZES)}, got {arch!r}.")
        embed_dim = tuple(embed_dim or HVIT3_SIZES[arch]["embed_dim"])
        depths = tuple(depths or HVIT3_SIZES[arch]["depths"])
        if not -1 <= frozen_stages <= len(depths):
            raise ValueError(f"frozen_stages must be in [-1, {len(depths)}], got {frozen_stages}.")
        super().__init__(in_chans=in_chans, embed_dim=embed_dim, depths=depths, mlp_ratio=mlp_ratio,
                         drop_path_rate=drop_path_rate, out_indices=out_indices)
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.init_cfg = init_cfg
        self.prefer_ema = prefer_ema
        self.out_channels = [embed_dim[i] for i in self.out_indices]
        self.set_grad_checkpointing(use_checkpoint or with_cp)
        self._freeze()

    def _frozen_modules(self) -> List[nn.Module]:
        if self.frozen_stages < 0:
            return []
        mods: List[nn.Module] = [self.patch_embed]
        for i in range(self.frozen_stages):
            mods.append(self.layers[i])
            if i in self.out_indices:
                mods.append(getattr(self, f"norm{i}"))
        return mods

    def init_weights(self) -> None:
        """Load ``init_cfg`` weights (mmengine calls this before training); no-op without a checkpoint."""
        path = _pretrained_path(self.init_cfg)
        if path is None:
            return
        load_hvit3_dense(self, load_checkpoint_file(path), self.prefer_ema)
        self.is_init = True


def load_hvit3_dense(model: HViT3Dense, ckpt: Dict[str, Any], prefer_ema: bool = False) -> Dict[str, List[str]]:
    """Load a det/seg or classification H-ViT3 checkpoint dict into ``model``; returns the fresh keys."""
    dense = mmengine_backbone(ckpt)
    if dense is not None:
        model.load_state_dict(backbone_filter_fn(dense, model))
        return dict(missing=[])
    sd = unwrap_checkpoint(ckpt, prefer_ema=prefer_ema)
    # classification -> dense: drop the head, the final BatchNorm ``norm.*`` and the unused RoPE tables;
    # the output norms ``norm0..3`` start fresh (LayerNorm 1/0), as in the official init_weights.
    sd = {k: v for k, v in sd.items()
          if not (k.startswith(("head.", "norm.", "head_drop.")) or k.endswith(".rope.rotations"))}
    fresh = [k for k in model.state_dict() if k.split(".")[0] in {f"norm{i}" for i in model.out_indices}]
    validate_state_dict(sd, model, ignore_prefixes=tuple(f"norm{i}." for i in model.out_indices))
    model.load_state_dict(sd, strict=False)
    return dict(missing=fresh)


class SimplePyramid(nn.Module):
    """ViTDet-style simple feature pyramid: one stride-s map -> 4 maps at strides s/4, s/2, s, 2s.

    Channels ``dim//4, dim//2, dim, dim``; an FPN neck follows in the configs.  With 4 input maps (BEiT style),
    level i is made from map i.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.up4 = nn.Sequential(nn.ConvTranspose2d(dim, dim // 2, 2, 2), LayerNorm2d(dim // 2), nn.GELU(),
                                 nn.ConvTranspose2d(dim // 2, dim // 4, 2, 2))
        self.up2 = nn.ConvTranspose2d(dim, dim // 2, 2, 2)
        self.down2 = nn.MaxPool2d(2, 2)
        self.out_channels = [dim // 4, dim // 2, dim, dim]

    def forward(self, feats: List[torch.Tensor]) -> List[torch.Tensor]:
        if len(feats) == 1:
            feats = [feats[0], feats[0], feats[0], feats[0]]
        return [self.up4(feats[0]), self.up2(feats[1]), feats[2], self.down2(feats[3])]


class TimmDense(_FreezeMixin, nn.Module):
    """Any ttt_zoo timm model as a 4-level dense backbone (uses the model's ``forward_intermediates``).

    Args:
        model_name: timm name, e.g. 'vit3_small', 'hvit3_tiny' (or a Vision-TTT model).
        model_kwargs: extra ``timm.create_model`` kwargs (e.g. drop_path_rate, img_size, embed_dim).
        out_indices: hierarchical models: stage indices (default all); plain models: one block index (ViTDet,
            default the last block) or four (BEiT style).
        frozen_stages: -1 none; 0 the stem (patch embedding); k >= 1 also the first k stages (hierarchical) or
            the first k blocks (plain, layer-wise freezing).
        init_cfg: ``dict(type='Pretrained', checkpoint=path)``: a classification checkpoint of ``model_name``
            (official or ours), or a det/seg checkpoint of this backbone (``backbone.*`` keys).
    """

    def __init__(self, model_name: str, model_kwargs: Optional[Dict[str, Any]] = None,
                 out_indices: Optional[Sequence[int]] = None, frozen_stages: int = -1, norm_eval: bool = False,
                 with_cp: bool = False, init_cfg: Optional[Dict[str, Any]] = None, prefer_ema: bool = False):
        super().__init__()
        import timm
        import ttt_zoo  # noqa: F401  (registers the models)
        from ttt_zoo.registry import list_zoo_models
        if model_name not in list_zoo_models():
            raise ValueError(f"{model_name!r} is not a ttt_zoo model; choose one of {list_zoo_models()}.")
        self.model = timm.create_model(model_name, pretrained=False, num_classes=0, **(model_kwargs or {}))
        info = self.model.feature_info
        self.plain = len({f["reduction"] for f in info}) == 1
        n = len(info)
        if out_indices is None:
            out_indices = (n - 1,) if self.plain else tuple(range(n))
        self.out_indices = tuple(i % n for i in out_indices)
        if self.plain and len(self.out_indices) not in (1, 4):
            raise ValueError(f"A plain model needs 1 (ViTDet) or 4 (BEiT-style) out_indices, got {out_indices}.")
        if not -1 <= frozen_stages <= n:
            raise ValueError(f"frozen_stages must be in [-1, {n}] for {model_name}, got {frozen_stages}.")
        if self.plain:
            dim = info[self.out_indices[-1]]["num_chs"]
            self.pyramid = SimplePyramid(dim)
            self.norms = None
            self.out_channels = self.pyramid.out_channels
        else:
            self.pyramid = None
            self.norms = nn.ModuleList([LayerNorm2d(info[i]["num_chs"], eps=1e-5) for i in self.out_indices])
            self.out_channels = [info[i]["num_chs"] for i in self.out_indices]
        self.model_name = model_name
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.init_cfg = init_cfg
        self.prefer_ema = prefer_ema
        self.model.set_grad_checkpointing(with_cp)
        self._freeze()

    def _frozen_modules(self) -> List[nn.Module]:
        if self.frozen_stages < 0:
            return []
        stem = self.model.pretrained_cfg.get("first_conv", "patch_embed").split(".")[0]
        mods = [self.model.get_submodule(stem)]
        for i in range(self.frozen_stages):
            mods.append(self.model.get_submodule(self.model.feature_info[i]["module"]))
        return mods

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        feats = self.model.forward_intermediates(x, indices=list(self.out_indices), norm=self.plain,
                                                 output_fmt="NCHW", intermediates_only=True)
        if self.pyramid is not None:
            return self.pyramid(feats)
        outs = []
        for i, norm in enumerate(self.norms):
            outs.append(norm(feats[i]))
        return outs

    def init_weights(self) -> None:
        path = _pretrained_path(self.init_cfg)
        if path is None:
            return
        ckpt = load_checkpoint_file(path)
        dense = mmengine_backbone(ckpt)
        if dense is not None:
            missing, unexpected = self.load_state_dict(dense, strict=False)
            if missing or unexpected:
                raise CheckpointError(
                    f"Det/seg checkpoint {path!r} does not fit TimmDense({self.model_name!r}): "
                    f"{len(missing)} missing keys {missing[:5]}, {len(unexpected)} unexpected {unexpected[:5]}.")
        else:
            sd = unwrap_checkpoint(ckpt, prefer_ema=self.prefer_ema)
            filter_fn = getattr(sys.modules[type(self.model).__module__], "checkpoint_filter_fn", None)
            sd = filter_fn(sd, self.model) if filter_fn is not None else sd
            sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
            validate_state_dict(sd, self.model)
            self.model.load_state_dict(sd, strict=False)
        self.is_init = True
