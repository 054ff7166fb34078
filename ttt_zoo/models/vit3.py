"""ViT3: a plain (non-hierarchical) vision transformer whose attention is the ViT3 TTT mixer.

"ViT3: Unlocking Test-Time Training in Vision" (arXiv 2512.01643).  No class token and no absolute position
embedding: each block starts with a residual depthwise-conv position encoding (CPE), and the head mean-pools.
Official keys are kept, so the authors' checkpoints load through :func:`checkpoint_filter_fn` unchanged.
"""

from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.utils.checkpoint
from torch import nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchEmbed, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from ttt_zoo.layers import TTTBlock
from ._common import build_ttt_model, check_image, drop_path_schedule, factory_device, unwrap_checkpoint, validate_state_dict, with_hub_ids

__all__ = ["ViT3"]


class ViT3(nn.Module):
    """Patch embedding -> TTT blocks (CPE, TTT mixer, MLP) -> LayerNorm -> mean pool -> head."""

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "avg",
            embed_dim: int = 192,
            depth: int = 12,
            num_heads: int = 6,
            mlp_ratio: float = 4.0,
            qkv_bias: bool = True,
            drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
            mixer: str = "vit3",
            mixer_kwargs: Optional[Dict[str, Any]] = None,
            device: Optional[Union[str, torch.device]] = None,
            dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        with factory_device(device):
            if global_pool not in ("avg", ""):
                raise ValueError(f"global_pool must be 'avg' or '' for ViT3, got {global_pool!r}")
            self.num_classes = num_classes
            self.global_pool = global_pool
            self.in_chans = in_chans
            self.patch_size = patch_size
            self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
            self.output_fmt = "NHWC"
            self.grad_checkpointing = False

            self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                          embed_dim=embed_dim, flatten=False, output_fmt="NHWC", strict_img_size=False)
            norm_layer = partial(nn.LayerNorm, eps=1e-6)
            dpr = drop_path_schedule(drop_path_rate, depth)
            self.blocks = nn.ModuleList([
                TTTBlock(embed_dim, num_heads, mixer=mixer, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                         proj_drop=proj_drop_rate, drop_path=dpr[i], norm_layer=norm_layer, mixer_kwargs=mixer_kwargs)
                for i in range(depth)])
            self.feature_info = [dict(num_chs=embed_dim, reduction=patch_size, module=f"blocks.{i}") for i in range(depth)]
            self.norm = norm_layer(embed_dim)
            self.head_drop = nn.Dropout(drop_rate)
            self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
            self.apply(self._init_weights)
            for blk in self.blocks:
                blk.attn.reset_inner_parameters()
        if dtype is not None:
            self.to(dtype=dtype)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        # official: every Linear (head included) trunc_normal(.02) / zero bias; convs keep PyTorch defaults
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    # ----- timm model API -----
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r"^patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            if global_pool not in ("avg", ""):
                raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
            self.global_pool = global_pool
        ref = self.patch_embed.proj.weight
        self.head = (nn.Linear(self.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
                     if num_classes > 0 else nn.Identity())
        self.head.train(self.training)

    # ----- forward -----
    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        check_image(x, self.in_chans, self.patch_size, self.patch_size, "ViT3")
        x = self.patch_embed(x)  # B, H, W, C
        feat_size = (x.shape[1], x.shape[2])
        return x.flatten(1, 2), feat_size

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the normalised (B, H, W, C) token map."""
        x, feat_size = self._embed(x)
        for blk in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = torch.utils.checkpoint.checkpoint(blk, x, feat_size, use_reentrant=False)
            else:
                x = blk(x, feat_size)
        x = self.norm(x)
        return x.reshape(x.shape[0], feat_size[0], feat_size[1], x.shape[-1])

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(1, 2))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Block outputs at stride ``patch_size`` as (B, C, H, W) (``NCHW``) or (B, N, C) (``NLC``)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        x, feat_size = self._embed(x)
        b = x.shape[0]
        last = max_index + 1 if stop_early else len(self.blocks)
        intermediates = []
        for i, blk in enumerate(self.blocks[:last]):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = torch.utils.checkpoint.checkpoint(blk, x, feat_size, use_reentrant=False)
            else:
                x = blk(x, feat_size)
            if i in take_indices:
                y = self.norm(x) if norm else x
                if output_fmt == "NCHW":
                    y = y.reshape(b, feat_size[0], feat_size[1], -1).permute(0, 3, 1, 2).contiguous()
                intermediates.append(y)
        if intermediates_only:
            return intermediates
        x = self.norm(x).reshape(b, feat_size[0], feat_size[1], -1)
        return x, intermediates

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: ViT3) -> Dict[str, torch.Tensor]:
    """Load official ViT3 checkpoints (``{'model': ...}`` from ``main.py``), ours, or a bare state dict."""
    sd = unwrap_checkpoint(state_dict)
    sd = {k: v for k, v in sd.items() if not k.startswith("head_dist.")}
    validate_state_dict(sd, model)
    return sd


def _create_vit3(variant: str, pretrained: bool = False, **kwargs) -> ViT3:
    out_indices = kwargs.pop("out_indices", 3)
    return build_ttt_model(
        ViT3, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs)


def _cfg(url: str = "", **kwargs) -> Dict[str, Any]:
    return {
        "url": url, "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (14, 14),
        "crop_pct": 0.9, "interpolation": "bicubic", "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head",
        "license": "apache-2.0", "paper_ids": "arXiv:2512.01643", "paper_name": "ViT3: Unlocking Test-Time Training in Vision",
        "origin_url": "https://github.com/LeapLabTHU/ViTTT", **kwargs,
    }


_TSINGHUA = "https://cloud.tsinghua.edu.cn/f/{}/?dl=1"

default_cfgs = generate_default_cfgs(with_hub_ids({
    "vit3_tiny.in1k": _cfg(url=_TSINGHUA.format("e12d1bd1c20c4e06a2da")),
    "vit3_small.in1k": _cfg(url=_TSINGHUA.format("4ab59ca54b474dff9b70")),
    "vit3_base.in1k": _cfg(url=_TSINGHUA.format("c9e9bb09f85d449ab8cf")),
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
