"""H-ViT3: the hierarchical ViT3 (conv stem, 4 stages of TTT blocks with 2-D RoPE, inverted-bottleneck merging).

"ViT3: Unlocking Test-Time Training in Vision" (arXiv 2512.01643).  Runs at any input size: the image is padded
right/bottom to a multiple of 4 and odd maps are padded before each stride-2 merge, as in the official detection
backbone; RoPE is computed for the runtime (H, W).  Official keys are kept.
"""

from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn
from timm.models import generate_default_cfgs, register_model

from ttt_zoo.layers import TTTBlock, family_mixer_kwargs, map_to_tokens, tokens_to_map
from ttt_zoo.layers.mixer import set_inner_steps
from ._common import (build_ttt_model, check_image, check_sizes, drop_path_schedule, image_cfg, init_weights,
                      reset_inner_parameters, run_blocks, unwrap_checkpoint, validate_state_dict, with_hub_ids)
from ._hierarchical import HierarchicalTTT, pad_to_multiple
from .vit3 import TSINGHUA_URL, VARIANTS, VIT3_PAPER, variant_kwargs

__all__ = ["HViT3", "HViT3Backbone", "HVIT3_SIZES", "ONE_BLOCK_KWARGS", "ConvNormAct", "Stem", "PatchMerging",
           "HViT3Stage"]

#: the H-ViT3 sizes (one table: the classifiers below, the dense-prediction backbones and the hub use it)
HVIT3_SIZES = {
    "tiny": dict(embed_dim=(64, 128, 320, 512), depths=(1, 3, 9, 4), num_heads=(2, 4, 10, 16)),
    "small": dict(embed_dim=(64, 128, 320, 512), depths=(2, 6, 18, 8), num_heads=(2, 4, 10, 16)),
    "base": dict(embed_dim=(96, 192, 448, 640), depths=(2, 6, 18, 8), num_heads=(3, 6, 14, 20)),
}
_TINY = HVIT3_SIZES["tiny"]
#: family -> the overrides that shrink its smallest model to one block in each of two stages (stem, blocks, a merge,
#: blocks, head: every code path; the compile checks)
ONE_BLOCK_KWARGS = {"hvit3": dict(depths=(1, 1), embed_dim=_TINY["embed_dim"][:2], num_heads=_TINY["num_heads"][:2])}


class ConvNormAct(nn.Module):
    """Conv2d -> [BatchNorm2d] -> [ReLU] (official keys ``conv``, ``norm``)."""

    def __init__(self, in_chs: int, out_chs: int, kernel_size: int = 3, stride: int = 1, groups: int = 1,
                 bias: bool = True, norm: bool = True, act: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(in_chs, out_chs, kernel_size, stride, kernel_size // 2, groups=groups, bias=bias)
        self.norm = nn.BatchNorm2d(out_chs) if norm else nn.Identity()
        self.act = nn.ReLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


class Stem(nn.Module):
    """Five conv layers, total stride 4: 3x3/2, 3x3, 3x3, 3x3/2 (to 4*C0), 1x1 (to C0, no act)."""

    def __init__(self, in_chans: int, embed_dim: int):
        super().__init__()
        half = embed_dim // 2
        self.conv = nn.Sequential(
            ConvNormAct(in_chans, half, 3, 2, bias=False),
            ConvNormAct(half, half, 3, 1, bias=False),
            ConvNormAct(half, half, 3, 1, bias=False),
            ConvNormAct(half, embed_dim * 4, 3, 2, bias=False),
            ConvNormAct(embed_dim * 4, embed_dim, 1, bias=False, act=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(pad_to_multiple(x, 4))


class PatchMerging(nn.Module):
    """Inverted bottleneck, stride 2: 1x1 (to 4*out) ReLU, dw 3x3/2 ReLU, 1x1 (to out) BN.  Odd maps are padded."""

    def __init__(self, dim: int, dim_out: int, ratio: float = 4.0):
        super().__init__()
        hidden = int(dim_out * ratio)
        self.conv = nn.Sequential(
            ConvNormAct(dim, hidden, 1, norm=False),
            ConvNormAct(hidden, hidden, 3, 2, groups=hidden, norm=False),
            ConvNormAct(hidden, dim_out, 1, act=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(pad_to_multiple(x, 2))


class HViT3Stage(nn.Module):
    """TTT blocks at one resolution, then (except in the last stage) a PatchMerging downsample."""

    def __init__(self, dim: int, dim_out: Optional[int], depth: int, num_heads: int, mlp_ratio: float,
                 qkv_bias: bool, drop_path: Sequence[float], proj_drop: float, mixer: str,
                 mixer_kwargs: Optional[Dict[str, Any]]):
        super().__init__()
        mk = family_mixer_kwargs(mixer, "vit3", dict(rope=True), mixer_kwargs)  # 2-D RoPE in the ViT3 mixer
        self.blocks = nn.ModuleList([
            TTTBlock(dim, num_heads, mixer=mixer, mlp_ratio=mlp_ratio, mlp_dwconv=True, qkv_bias=qkv_bias,
                     proj_drop=proj_drop, drop_path=drop_path[i], mixer_kwargs=mk)
            for i in range(depth)])
        self.downsample = PatchMerging(dim, dim_out) if dim_out is not None else None
        self.grad_checkpointing = False

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W) through the TTT blocks."""
        feat_size = (x.shape[2], x.shape[3])
        t = map_to_tokens(x).contiguous()  # tokens, not a view of the map (faster norms; see tokens_to_map)
        if torch.jit.is_scripting():  # no checkpointing in TorchScript
            for blk in self.blocks:
                t = blk(t, feat_size)
        else:
            t = run_blocks(self.blocks, t, feat_size, grad_checkpointing=self.grad_checkpointing)
        return tokens_to_map(t, feat_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_blocks(x)
        return self.downsample(x) if self.downsample is not None else x


class HViT3(HierarchicalTTT):
    """Stem (stride 4) -> 4 stages -> BatchNorm -> mean pool -> head."""

    def __init__(
            self,
            embed_dim: Sequence[int] = _TINY["embed_dim"],
            depths: Sequence[int] = _TINY["depths"],
            num_heads: Sequence[int] = _TINY["num_heads"],
            mlp_ratio: float = 4.0,
            qkv_bias: bool = True,
            drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
            mixer: str = "vit3",
            mixer_kwargs: Optional[Dict[str, Any]] = None,
            **kwargs,
    ):
        """Per-stage ``embed_dim``, ``depths``, ``num_heads``; timm's usual arguments go to :class:`HierarchicalTTT`."""
        check_sizes("H-ViT3", embed_dim=embed_dim, depths=depths, num_heads=num_heads)
        if not (len(embed_dim) == len(depths) == len(num_heads)):
            raise ValueError("embed_dim, depths and num_heads need one entry per stage")
        super().__init__(embed_dim[-1], display_name="H-ViT3", **kwargs)
        self.embed_dim = list(embed_dim)
        self.num_stages = len(depths)
        # forward_features is NCHW (timm's output_fmt, as ConvNeXt): the official stem, merges and final BatchNorm
        # are convolutions over channels-first maps (docs/models.md, "forward_features layout")
        self.output_fmt = "NCHW"

        self.patch_embed = Stem(self.in_chans, embed_dim[0])
        self.pos_drop = nn.Dropout(drop_rate)
        self.init_stages(depths, embed_dim, drop_path_rate, lambda i, dpr: HViT3Stage(
            embed_dim[i], embed_dim[i + 1] if i + 1 < self.num_stages else None, depths[i], num_heads[i], mlp_ratio,
            qkv_bias, dpr, proj_drop_rate, mixer, mixer_kwargs))
        # official: BatchNorm1d over (B, C, N), same keys and math
        self.init_norm_head(nn.BatchNorm2d(self.num_features), drop_rate)

    @torch.jit.ignore
    def set_inner_steps(self, steps: int) -> None:
        """k inner steps on (k, v) in every mixer (Figure 1 of Liu et al., "TTT with KV Binding Is Secretly Linear
        Attention", varies it at inference)."""
        set_inner_steps(self, steps)

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        check_image(x, self.in_chans, 1, 1, "HViT3")
        return self.pos_drop(self.patch_embed(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # here, not in the base class: torch.fx then autowraps this module's check_image / pad_to_multiple
        return self.forward_head(self.forward_features(x))

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        take_indices = super().prune_intermediate_layers(indices, prune_norm, prune_head)
        self.layers[-1].downsample = None
        return take_indices


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: HViT3) -> Dict[str, torch.Tensor]:
    """Load official H-ViT3 checkpoints: ``{'model', 'state_dict_ema', ...}`` from ``main_ema.py`` (the EMA weights
    are chosen when present, since the released H-ViT3 results are those of the EMA-trained runs), ``{'model': ...}``,
    ours, or a bare state dict.  The fixed-size RoPE tables (``*.rope.rotations``) are dropped: RoPE is computed
    for the runtime size."""
    sd = unwrap_checkpoint(state_dict)
    sd = {k: v for k, v in sd.items() if not k.endswith(".rope.rotations")}
    validate_state_dict(sd, model)
    return sd


def _create_hvit3(variant: str, pretrained: bool = False, **kwargs) -> HViT3:
    return build_ttt_model(HViT3, variant, pretrained, default_out_indices=(0, 1, 2, 3),
                           pretrained_filter_fn=checkpoint_filter_fn, **kwargs)


def _cfg(url: str = "", **kwargs) -> Dict[str, Any]:
    return image_cfg(url, pool_size=(7, 7), crop_pct=0.875, first_conv="patch_embed.conv.0.conv", **VIT3_PAPER,
                     **kwargs)


default_cfgs = generate_default_cfgs(with_hub_ids({
    "hvit3_tiny.in1k": _cfg(url=TSINGHUA_URL.format("f0c7c73ceabe49b7b161")),
    "hvit3_small.in1k": _cfg(url=TSINGHUA_URL.format("3eeab8621a7f43929a87")),
    "hvit3_base.in1k": _cfg(url=TSINGHUA_URL.format("1d0d7fb840254275b29d")),
    **{f"hvit3_tiny_{v}": _cfg() for v in VARIANTS},
}))


@register_model
def hvit3_tiny(pretrained: bool = False, **kwargs) -> HViT3:
    """H-ViT3-T: 28.7M params, 4.9 GFLOPs, 84.0% top-1 (paper, MESA + EMA)."""
    return _create_hvit3("hvit3_tiny", pretrained, **dict(HVIT3_SIZES["tiny"], **kwargs))


@register_model
def hvit3_small(pretrained: bool = False, **kwargs) -> HViT3:
    """H-ViT3-S: 54.4M params, 8.8 GFLOPs, 84.9% top-1 (paper, MESA + EMA)."""
    return _create_hvit3("hvit3_small", pretrained, **dict(HVIT3_SIZES["small"], **kwargs))


@register_model
def hvit3_base(pretrained: bool = False, **kwargs) -> HViT3:
    """H-ViT3-B: 94.4M params, 16.7 GFLOPs, 85.5% top-1 (paper, MESA + EMA)."""
    return _create_hvit3("hvit3_base", pretrained, **dict(HVIT3_SIZES["base"], **kwargs))


# Table 2 variants of Liu et al. (see ``vit3.VARIANTS``); the tiny size only, to keep timm's suite cheap: other
# sizes are ``hvit3_small(mixer_kwargs=VARIANTS['v1'])``.
@register_model
def hvit3_tiny_v1(pretrained: bool = False, **kwargs) -> HViT3:
    """H-ViT3-T, Table 2 "Variant 1" (Liu et al.): only the last inner layer w1 updates; the gate w2 is static."""
    return _create_hvit3("hvit3_tiny_v1", pretrained, **dict(HVIT3_SIZES["tiny"], **variant_kwargs("v1", kwargs)))


@register_model
def hvit3_tiny_v3(pretrained: bool = False, **kwargs) -> HViT3:
    """H-ViT3-T, Table 2 "Variant 3": V1 with a single linear inner layer (RoPE'd q, k; no w2)."""
    return _create_hvit3("hvit3_tiny_v3", pretrained, **dict(HVIT3_SIZES["tiny"], **variant_kwargs("v3", kwargs)))


@register_model
def hvit3_tiny_v6(pretrained: bool = False, **kwargs) -> HViT3:
    """H-ViT3-T, Table 2 "Variant 6": V3 without gradient normalisation (plain linear attention)."""
    return _create_hvit3("hvit3_tiny_v6", pretrained, **dict(HVIT3_SIZES["tiny"], **variant_kwargs("v6", kwargs)))


class HViT3Backbone(nn.Module):
    """Dense-prediction H-ViT3 (official mmdet/mmseg ``ViTTT`` layout): stage outputs after LayerNorms
    ``norm{i}`` at strides 4/8/16/32; no final BatchNorm and no head.  Heads default to ``dim // 32``."""

    def __init__(self, in_chans: int = 3, embed_dim: Sequence[int] = _TINY["embed_dim"],
                 depths: Sequence[int] = _TINY["depths"], num_heads: Optional[Sequence[int]] = None,
                 mlp_ratio: float = 4.0, drop_path_rate: float = 0.1, out_indices: Sequence[int] = (0, 1, 2, 3),
                 mixer: str = "vit3", mixer_kwargs: Optional[Dict[str, Any]] = None):
        super().__init__()
        num_heads = num_heads or [d // 32 for d in embed_dim]
        check_sizes("H-ViT3 backbone", embed_dim=embed_dim, depths=depths, num_heads=num_heads)
        self.out_indices = tuple(out_indices)
        self.in_chans = in_chans
        self.embed_dim = list(embed_dim)
        for i in self.out_indices:
            self.add_module(f"norm{i}", nn.LayerNorm(embed_dim[i]))
        self.patch_embed = Stem(in_chans, embed_dim[0])
        dpr = drop_path_schedule(drop_path_rate, sum(depths))
        self.layers = nn.ModuleList([
            HViT3Stage(embed_dim[i], embed_dim[i + 1] if i + 1 < len(depths) else None, depths[i], num_heads[i],
                       mlp_ratio, True, dpr[sum(depths[:i]):sum(depths[:i + 1])], 0.0, mixer, mixer_kwargs)
            for i in range(len(depths))])
        self.apply(init_weights)
        reset_inner_parameters(self)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.layers:
            stage.grad_checkpointing = enable

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        check_image(x, self.in_chans, 1, 1, type(self).__name__)
        x = self.patch_embed(x)
        outs = []
        for i, stage in enumerate(self.layers):
            x = stage.forward_blocks(x)
            if i in self.out_indices:
                norm = getattr(self, f"norm{i}")
                outs.append(norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous())
            if stage.downsample is not None:
                x = stage.downsample(x)
        return outs


def backbone_filter_fn(state_dict: Dict[str, Any], model: HViT3Backbone) -> Dict[str, torch.Tensor]:
    """Official det/seg backbone checkpoints (``backbone.`` prefix from mmengine, unused RoPE buffers dropped)."""
    sd = unwrap_checkpoint(state_dict)
    if any(k.startswith("backbone.") for k in sd):
        sd = {k[len("backbone."):]: v for k, v in sd.items() if k.startswith("backbone.")}
    sd = {k: v for k, v in sd.items() if not k.endswith(".rope.rotations")}
    validate_state_dict(sd, model, ignore_prefixes=())
    return sd
