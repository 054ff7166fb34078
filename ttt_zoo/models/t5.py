"""T5: a ViT linearized with test-time training, and T5+ (TTT averaged with neighbourhood attention).

"Linearizing Vision Transformer with Test-Time Training" (T5 / DiT5, arXiv 2605.02772).  A plain ViT with a
learned absolute position embedding (no class token) whose softmax attention is the T5 TTT mixer; the head
mean-pools.  The position embedding is resampled for any input size the patch size allows, non-square included.
Official keys are kept (``Transformer-to-TTT/T5/models.py``).  Use :func:`ttt_zoo.linearize` to build one from a
pretrained timm ViT / DeiT.
"""

from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.utils.checkpoint
from torch import nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchEmbed, register_notrace_function, resample_abs_pos_embed, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from ttt_zoo.layers import TTTBlock
from ._common import CheckpointError, build_ttt_model, check_image, unwrap_checkpoint, validate_state_dict

__all__ = ["T5", "resample_pos_embed"]


@register_notrace_function
def resample_pos_embed(pos_embed: torch.Tensor, grid_size: Tuple[int, int], feat_size: Tuple[int, int]) -> torch.Tensor:
    """(1, gh*gw, C) learned embedding -> (1, H*W, C) for the runtime map (bicubic, as timm's ViT)."""
    if grid_size[0] == feat_size[0] and grid_size[1] == feat_size[1]:
        return pos_embed
    return resample_abs_pos_embed(pos_embed, new_size=[feat_size[0], feat_size[1]],
                                  old_size=[grid_size[0], grid_size[1]], num_prefix_tokens=0)


class T5(nn.Module):
    """Patch embedding + pos_embed -> TTT blocks (no CPE) -> LayerNorm -> mean pool -> head."""

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "avg",
            embed_dim: int = 192,
            depth: int = 12,
            num_heads: int = 3,
            mlp_ratio: float = 4.0,
            qkv_bias: bool = True,
            na_kernel: int = 0,
            drop_rate: float = 0.0,
            pos_drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
    ):
        """
        Args:
            na_kernel: 0 for T5; 5 (paper default) or 3 for T5+ (neighbourhood attention averaged in, Eq. 15).
            Others as timm's VisionTransformer.
        """
        super().__init__()
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool must be 'avg' or '' for T5, got {global_pool!r}")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.in_chans = in_chans
        self.patch_size = patch_size
        self.na_kernel = na_kernel
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.output_fmt = "NHWC"
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, flatten=False, output_fmt="NHWC", strict_img_size=False)
        self.grid_size: Tuple[int, int] = (int(self.patch_embed.grid_size[0]), int(self.patch_embed.grid_size[1]))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size[0] * self.grid_size[1], embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList([
            TTTBlock(embed_dim, num_heads, mixer="t5", mlp_ratio=mlp_ratio, cpe=False, qkv_bias=qkv_bias,
                     proj_drop=proj_drop_rate, drop_path=dpr[i], norm_layer=norm_layer,
                     mixer_kwargs=dict(na_kernel=na_kernel))
            for i in range(depth)])
        self.feature_info = [dict(num_chs=embed_dim, reduction=patch_size, module=f"blocks.{i}") for i in range(depth)]
        self.norm = norm_layer(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if self.pos_embed.device.type != "meta":
            trunc_normal_(self.pos_embed, std=0.02)
        self.apply(self._init_weights)
        for blk in self.blocks:
            blk.attn.reset_inner_parameters()

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        # official: every Linear (head included) trunc_normal(.02) / zero bias; LayerNorm 1/0; convs PyTorch default
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
        return {"pos_embed"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r"^pos_embed|^patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

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
        ref = self.pos_embed  # (the final norm may have been pruned away)
        self.head = (nn.Linear(self.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
                     if num_classes > 0 else nn.Identity())
        self.head.train(self.training)

    # ----- forward -----
    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        min_size = self.patch_size * max(self.na_kernel, 1)
        check_image(x, self.in_chans, self.patch_size, min_size, "T5")
        x = self.patch_embed(x)  # B, H, W, C
        feat_size = (x.shape[1], x.shape[2])
        x = x.flatten(1, 2) + resample_pos_embed(self.pos_embed, self.grid_size, feat_size)
        return self.pos_drop(x), feat_size

    def _run_block(self, i: int, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        blk = self.blocks[i]
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return torch.utils.checkpoint.checkpoint(blk, x, feat_size, use_reentrant=False)
        return blk(x, feat_size)

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
        for i in range(last):
            x = self._run_block(i, x, feat_size)
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


def _square_side(n: int) -> int:
    s = int(round(n ** 0.5))
    return s if s * s == n else -1


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: T5) -> Dict[str, torch.Tensor]:
    """Load official T5 checkpoints (``{'model', 'model_ema', ...}`` from ``T5/main.py``), ours, or a bare dict.

    The raw ``model`` entry is used (the official evaluation reports it); a ``pos_embed`` for another square grid
    (or with a leading class-token entry) is resampled to the model's grid.
    """
    if isinstance(state_dict, dict) and isinstance(state_dict.get("model"), dict):
        state_dict = state_dict["model"]
    sd = unwrap_checkpoint(state_dict)
    sd = {k: v for k, v in sd.items() if not k.startswith("head_dist.")}
    pe = sd.get("pos_embed")
    if pe is not None and pe.dim() == 3 and pe.shape[1] != model.pos_embed.shape[1]:
        n = pe.shape[1]
        side = _square_side(n)
        if side < 0 and _square_side(n - 1) > 0:  # DeiT/ViT layout with a class-token entry first
            pe, side = pe[:, 1:], _square_side(n - 1)
        if side < 0:
            raise CheckpointError(f"pos_embed with {n} tokens is not a square grid; cannot resample it to "
                                  f"the model's {model.grid_size[0]}x{model.grid_size[1]} grid.")
        sd["pos_embed"] = resample_abs_pos_embed(pe, new_size=list(model.grid_size), old_size=[side, side],
                                                 num_prefix_tokens=0)
    validate_state_dict(sd, model)
    return sd


def _create_t5(variant: str, pretrained: bool = False, **kwargs) -> T5:
    out_indices = kwargs.pop("out_indices", 3)
    return build_ttt_model(
        T5, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs)


def _cfg(url: str = "", **kwargs) -> Dict[str, Any]:
    return {
        "url": url, "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": (14, 14),
        "crop_pct": 0.875, "interpolation": "bicubic", "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj", "classifier": "head",
        "license": "apache-2.0", "paper_ids": "arXiv:2605.02772",
        "paper_name": "Linearizing Vision Transformer with Test-Time Training",
        "origin_url": "https://github.com/LeapLabTHU/Transformer-to-TTT", **kwargs,
    }


# no trained T5 weights are released; build from a softmax ViT with ttt_zoo.linearize()
default_cfgs = generate_default_cfgs({
    "t5_tiny.untrained": _cfg(),
    "t5_small.untrained": _cfg(),
    "t5_base.untrained": _cfg(),
    "t5_plus_tiny.untrained": _cfg(),
    "t5_plus_small.untrained": _cfg(),
    "t5_plus_base.untrained": _cfg(),
})

_TINY = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
_SMALL = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
_BASE = dict(patch_size=16, embed_dim=512, depth=24, num_heads=8)


@register_model
def t5_tiny(pretrained: bool = False, **kwargs) -> T5:
    """T5-T (DeiT-T layout): 6,205,480 params."""
    return _create_t5("t5_tiny", pretrained, **dict(_TINY, **kwargs))


@register_model
def t5_small(pretrained: bool = False, **kwargs) -> T5:
    """T5-S (DeiT-S layout): 23,026,792 params."""
    return _create_t5("t5_small", pretrained, **dict(_SMALL, **kwargs))


@register_model
def t5_base(pretrained: bool = False, **kwargs) -> T5:
    """T5-B (official: 512 wide, 24 deep, 8 heads): 79,270,376 params."""
    return _create_t5("t5_base", pretrained, **dict(_BASE, **kwargs))


@register_model
def t5_plus_tiny(pretrained: bool = False, **kwargs) -> T5:
    """T5+-T: T5-T averaged with 5x5 neighbourhood attention (``na_kernel=3`` for NAT3); no extra params."""
    return _create_t5("t5_plus_tiny", pretrained, **dict(_TINY, na_kernel=5) | kwargs)


@register_model
def t5_plus_small(pretrained: bool = False, **kwargs) -> T5:
    """T5+-S: T5-S averaged with 5x5 neighbourhood attention (``na_kernel=3`` selectable)."""
    return _create_t5("t5_plus_small", pretrained, **dict(_SMALL, na_kernel=5) | kwargs)


@register_model
def t5_plus_base(pretrained: bool = False, **kwargs) -> T5:
    """T5+-B: T5-B averaged with 5x5 neighbourhood attention (``na_kernel=3`` selectable)."""
    return _create_t5("t5_plus_base", pretrained, **dict(_BASE, na_kernel=5) | kwargs)
