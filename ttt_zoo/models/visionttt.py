"""Vision-TTT (Vittt): plain and hierarchical backbones whose token mixer is bidirectional TTT-Linear.

"Vision-TTT" (Kong, Xiao, Shen, Wang).  The authors' code is not public: the block follows the reconstruction
in ``shared/spec/visionttt.md`` §2 (the mixer is :class:`ttt_zoo.layers.TTTLinearMixer`), which reproduces the
paper's parameter and FLOP counts.  Plain models: patch 16, learnable absolute position embedding (resampled for
other input sizes), 12 blocks ``y += Vittt(LN(y)); y += SwiGLU(LN(y))``, LN, mean pool, head.  Hierarchical
models (Vittt-H): Swin layout (4x4 stem + LN, PatchMerging between stages), no windows: every stage scans its
whole map.  Registered as ``visionttt_*`` (``vittt_*`` belongs to the official ViT3 code).
"""

import math
from functools import partial
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import register_notrace_function
from timm.models import generate_default_cfgs, register_model

from ttt_zoo.kernels.backend import resolve_backend, tracing
from ttt_zoo.kernels.utils import launches_kernel
from ttt_zoo.layers import TTTBlock, family_mixer_kwargs
from ttt_zoo.layers.recompute import can_recompute, linear_of_recomputed
from ._common import (build_ttt_model, check_image, check_sizes, image_cfg, run_blocks, unwrap_checkpoint,
                      validate_state_dict)
from ._hierarchical import HierarchicalTTT, pad_to_multiple
from ._plain import PlainTTTViT, fit_checkpoint_pos_embed

__all__ = ["VisionTTT", "VisionTTTH", "SwiGluMlp", "PatchMerging", "VISIONTTT_SIZES", "VISIONTTT_H_SIZES",
           "ONE_BLOCK_KWARGS"]

#: the plain Vision-TTT sizes (heads = width / head_dim); the ``_la`` models share them
VISIONTTT_SIZES = {
    "tiny": dict(patch_size=16, embed_dim=192, depth=12, head_dim=64),
    "small": dict(patch_size=16, embed_dim=384, depth=12, head_dim=64),
    "base": dict(patch_size=16, embed_dim=768, depth=12, head_dim=64),
}
#: the hierarchical Vision-TTT-H sizes (stem width, doubling per stage; Swin-T/S/B depths)
VISIONTTT_H_SIZES = {
    "tiny": dict(embed_dim=96, depths=(2, 2, 6, 2)),
    "small": dict(embed_dim=96, depths=(2, 2, 18, 2)),
    "base": dict(embed_dim=128, depths=(2, 2, 18, 2)),
}
#: family -> the overrides that shrink its smallest model to one block (per stage; Vision-TTT-H keeps two stages:
#: stem, blocks, a merge, blocks, head: every code path; the compile checks)
ONE_BLOCK_KWARGS = {"visionttt": dict(depth=1), "visionttt_h": dict(depths=(1, 1), head_dim=(32, 32))}


class SwiGluMlp(nn.Module):
    """``fc2(silu(gate) * value)`` with ``[gate, value] = fc1(x)``; hidden rounded up to a multiple of 8.  In
    training ``silu(gate) * value`` is recomputed in the backward (``recompute_act = False`` keeps it).  Where
    ``backend`` resolves to Triton for the Vision-TTT op (eager), ``silu(gate) * value`` is one kernel forward and
    one backward (``kernels/ttt_linear/gate.py``)."""

    recompute_act: bool = True

    def __init__(self, dim: int, hidden_dim: int, bias: bool = True, drop: float = 0.0,
                 backend: Optional[str] = None):
        super().__init__()
        hidden_dim = int(math.ceil(hidden_dim / 8) * 8)
        self.hidden_dim = hidden_dim
        self.backend = backend
        self.fc1 = nn.Linear(dim, 2 * hidden_dim, bias=bias)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.drop = nn.Dropout(drop)

    @staticmethod
    def _mid(h: torch.Tensor) -> torch.Tensor:
        gate, value = h.chunk(2, dim=-1)
        return F.silu(gate) * value

    @torch.jit.unused
    def _kernels(self, h: torch.Tensor):
        """``(silu_mul, silu_mul_vjp)`` of the Triton path, or None: the aten ops (graph capture, or a backend
        that resolves to PyTorch for the Vision-TTT op)."""
        if isinstance(h, torch.fx.Proxy) or tracing() or not launches_kernel(True, h):
            return None
        if resolve_backend(self.backend, h.device, h.dtype, None, "ttt_linear_bidir") != "triton":
            return None
        from ttt_zoo.kernels.ttt_linear.gate import silu_mul, silu_mul_vjp  # Triton: imported where it runs
        return silu_mul, silu_mul_vjp

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        h = self.fc1(x)
        if not torch.jit.is_scripting():
            kernels = self._kernels(h)
            if can_recompute(self, h):  # training: keep fc1's output only (ttt_zoo.layers.recompute)
                if kernels is not None:
                    return linear_of_recomputed(kernels[0], h, self.fc2, mid_vjp=kernels[1])
                return linear_of_recomputed(self._mid, h, self.fc2)
            if kernels is not None:
                return self.drop(self.fc2(kernels[0](h)))
        return self.drop(self.fc2(self._mid(h)))


def _no_num_heads(name: str, num_heads: Any) -> None:
    if num_heads is not None:  # accepted only to say so: the heads follow from head_dim
        raise ValueError(f"{name}: num_heads={num_heads!r} is not an option; its heads are width / head_dim: give "
                         f"head_dim instead")


def _vittt_heads(dim: int, head_dim: int, mixer: str, mixer_kwargs: Optional[Dict[str, Any]]
                 ) -> Tuple[int, Dict[str, Any]]:
    """(num_heads, mixer kwargs) for width ``dim``; ``head_dim`` is also an option of the TTT-Linear mixer."""
    if dim % head_dim:
        raise ValueError(f"width {dim} is not divisible by head_dim {head_dim}")
    mk = family_mixer_kwargs(mixer, "ttt_linear", dict(head_dim=head_dim), mixer_kwargs)
    return dim // mk.get("head_dim", head_dim), mk


def _make_blocks(dim: int, depth: int, head_dim: int, drop_path: Sequence[float], proj_drop: float, qkv_bias: bool,
                 mlp_ratio: float, mixer: str, mixer_kwargs: Optional[Dict[str, Any]]) -> nn.ModuleList:
    num_heads, mk = _vittt_heads(dim, head_dim, mixer, mixer_kwargs)
    norm_layer = partial(nn.LayerNorm, eps=1e-6)
    return nn.ModuleList([
        TTTBlock(dim, num_heads, mixer=mixer, mlp_ratio=mlp_ratio, cpe=False, qkv_bias=qkv_bias,
                 proj_drop=proj_drop, drop_path=drop_path[i], norm_layer=norm_layer,
                 mlp_layer=partial(SwiGluMlp, drop=proj_drop, backend=mk.get("backend")), mixer_kwargs=mk)
        for i in range(depth)])


class VisionTTT(PlainTTTViT):
    """Patch embedding + position embedding -> Vittt blocks (TTT-Linear mixer, SwiGLU) -> LN -> mean pool -> head."""

    def __init__(self, embed_dim: int = 192, head_dim: int = 64, mlp_ratio: float = 8.0 / 3.0,
                 proj_drop_rate: float = 0.0, mixer: str = "ttt_linear", mixer_kwargs: Optional[Dict[str, Any]] = None,
                 num_heads: Optional[int] = None, **kwargs):
        """Args: ``head_dim`` (heads = width / head_dim), others those of :class:`PlainTTTViT`."""
        _no_num_heads("Vision-TTT", num_heads)
        check_sizes("Vision-TTT", embed_dim=embed_dim, head_dim=head_dim)
        num_heads, mk = _vittt_heads(embed_dim, head_dim, mixer, mixer_kwargs)
        super().__init__(
            embed_dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, mixer=mixer, mixer_kwargs=mk, cpe=False,
            pos_embed=True, proj_drop_rate=proj_drop_rate,
            mlp_layer=partial(SwiGluMlp, drop=proj_drop_rate, backend=mk.get("backend")),
            **kwargs)


@register_notrace_function
def _pad_even(x: torch.Tensor) -> torch.Tensor:
    """Zero-pad a (B, H, W, C) map on the bottom/right to even H and W."""
    return F.pad(x, (0, 0, 0, x.shape[2] % 2, 0, x.shape[1] % 2))


class PatchMerging(nn.Module):
    """Swin patch merging on (B, H, W, C): 2x2 neighbours concatenated, LN(4C), Linear(4C -> out, no bias)."""

    def __init__(self, dim: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_even(x)
        b, h, w, c = x.shape
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class VisionTTTStage(nn.Module):
    """[PatchMerging] -> Vittt blocks over the whole (H, W) map, on (B, H, W, C)."""

    def __init__(self, dim: int, out_dim: int, depth: int, head_dim: int, downsample: bool,
                 drop_path: Sequence[float], proj_drop: float, qkv_bias: bool, mlp_ratio: float, mixer: str,
                 mixer_kwargs: Optional[Dict[str, Any]]):
        super().__init__()
        self.downsample = PatchMerging(dim, out_dim) if downsample else None
        self.blocks = _make_blocks(out_dim, depth, head_dim, drop_path, proj_drop, qkv_bias, mlp_ratio, mixer,
                                   mixer_kwargs)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.downsample is not None:
            x = self.downsample(x)
        return self.forward_blocks(x)

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) -> (B, H, W, C) through the Vittt blocks."""
        b, h, w, c = x.shape
        feat_size = (h, w)
        t = x.reshape(b, h * w, c)
        if torch.jit.is_scripting():  # no checkpointing in TorchScript
            for blk in self.blocks:
                t = blk(t, feat_size)
        else:
            t = run_blocks(self.blocks, t, feat_size, grad_checkpointing=self.grad_checkpointing)
        return t.reshape(b, h, w, c)


class VisionTTTH(HierarchicalTTT):
    """Vittt-H: 4x4 stem + LN -> 4 stages (PatchMerging, Vittt blocks) -> LN -> mean pool -> head.

    Any input size works: the image is zero-padded right/bottom to a multiple of 4 and odd maps are padded before
    each merge (as Swin does).  ``head_dim`` is per stage; default (32, 32, 32, 32) is the spec's variant A
    (Swin's heads), (32, 64, 64, 64) variant B.
    """
    downsample_first = True
    intermediate_fmts = ("NCHW", "NHWC")

    def __init__(
            self,
            embed_dim: int = 96,
            depths: Sequence[int] = (2, 2, 6, 2),
            head_dim: Sequence[int] = (32, 32, 32, 32),
            mlp_ratio: float = 8.0 / 3.0,
            qkv_bias: bool = True,
            drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            drop_path_rate: float = 0.1,
            mixer: str = "ttt_linear",
            mixer_kwargs: Optional[Dict[str, Any]] = None,
            num_heads: Optional[Sequence[int]] = None,
            **kwargs,
    ):
        """Stem width ``embed_dim`` (doubling per stage); timm's usual arguments go to :class:`HierarchicalTTT`."""
        _no_num_heads("Vision-TTT-H", num_heads)
        check_sizes("Vision-TTT-H", embed_dim=embed_dim, depths=depths, head_dim=head_dim)
        super().__init__(embed_dim * 2 ** (len(depths) - 1), **kwargs)
        if len(head_dim) != len(depths):
            raise ValueError(f"head_dim needs one entry per stage ({len(depths)}), got {tuple(head_dim)}")
        self.num_stages = len(depths)
        dims = [embed_dim * 2 ** i for i in range(self.num_stages)]
        self.embed_dim = dims
        # forward_features is NHWC (timm's output_fmt, as Swin, whose layout this is): stem LN, merges and blocks all
        # work channels-last (docs/models.md, "forward_features layout")
        self.output_fmt = "NHWC"

        self.patch_embed = nn.Sequential()
        self.patch_embed.add_module("proj", nn.Conv2d(self.in_chans, embed_dim, 4, 4))
        self.patch_embed.add_module("norm", nn.LayerNorm(embed_dim))
        self.init_stages(depths, dims, drop_path_rate, lambda i, dpr: VisionTTTStage(
            dims[max(i - 1, 0)], dims[i], depths[i], head_dim[i], i > 0, dpr, proj_drop_rate, qkv_bias, mlp_ratio,
            mixer, mixer_kwargs))
        self.init_norm_head(nn.LayerNorm(self.num_features), drop_rate)

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        check_image(x, self.in_chans, 1, 1, self.model_name)
        x = self.patch_embed.proj(pad_to_multiple(x, 4)).permute(0, 2, 3, 1)
        return self.patch_embed.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # here, not in the base class: torch.fx then autowraps this module's check_image / pad_to_multiple
        return self.forward_head(self.forward_features(x))


# ----------------------------------------------------------------------------- analysis utility
@torch.no_grad()
def gradient_magnitude_map(model: nn.Module, x: torch.Tensor, block: int = -1, direction: str = "sum"
                           ) -> torch.Tensor:
    """Vision-TTT's gradient-magnitude map (Eq. 6, Fig. 8): per token ``||grad_W l_t||_F`` of one block's inner
    loss, at the state the token's gradient is taken from (its mini-batch's incoming state), with W the
    block-diagonal multi-head state (so the heads' Frobenius norms add in quadrature).

    Args:
        model: a :class:`VisionTTT` (``block`` indexes ``model.blocks``) or :class:`VisionTTTH` (``block`` indexes
            the blocks of all stages in order).
        x: image batch (B, 3, H_img, W_img).
        direction: ``'forth'``, ``'back'`` (the flipped scan, shown in raster order) or ``'sum'`` of both.
    Returns:
        (B, H, W) map at the block's resolution.
    """
    if direction not in ("forth", "back", "sum"):
        raise ValueError(f"direction must be 'forth', 'back' or 'sum', got {direction!r}")
    if isinstance(model, VisionTTT):
        blocks = list(model.blocks)
    elif isinstance(model, VisionTTTH):
        blocks = [blk for stage in model.layers for blk in stage.blocks]
    else:
        raise TypeError(f"gradient_magnitude_map needs a VisionTTT or VisionTTTH model, got {type(model).__name__}")
    blk = blocks[block]
    captured = {}

    def hook(module, args):
        captured["x"], captured["feat_size"] = args[0], tuple(args[1])
        raise _Stop

    mixer = blk.attn
    handle = mixer.register_forward_pre_hook(hook)
    try:
        model.forward_features(x)
    except _Stop:
        pass
    finally:
        handle.remove()
    feat_size = captured["feat_size"]
    gn = mixer.inner_grad_norm(captured["x"], feat_size)  # (2, B, N); the hook saw norm1's output
    gn = gn[0] if direction == "forth" else gn[1] if direction == "back" else gn.sum(0)
    return gn.reshape(gn.shape[0], feat_size[0], feat_size[1])


class _Stop(Exception):
    pass


# ----------------------------------------------------------------------------- checkpoints, registry
def checkpoint_filter_fn(state_dict: Dict[str, Any], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Our checkpoints (bare or ``{'model': ...}``); a position embedding of another grid (or with one extra
    class-token slot, the paper's (T+1) x D) is resampled to the model's grid."""
    sd = unwrap_checkpoint(state_dict)
    if isinstance(model, VisionTTT):
        fit_checkpoint_pos_embed(sd, model)
    validate_state_dict(sd, model)
    return sd


def _create(cls, variant: str, pretrained: bool, default_out: Any, **kwargs) -> nn.Module:
    return build_ttt_model(cls, variant, pretrained, default_out_indices=default_out,
                           pretrained_filter_fn=checkpoint_filter_fn, **kwargs)


def _cfg(pool_size: Tuple[int, int] = (7, 7)) -> Dict[str, Any]:
    return image_cfg(pool_size=pool_size, crop_pct=0.875, first_conv="patch_embed.proj", paper_name="Vision-TTT",
                     origin_url="https://github.com/imKQv/Vittt")


default_cfgs = generate_default_cfgs({
    "visionttt_tiny": _cfg(pool_size=(14, 14)),
    "visionttt_small": _cfg(pool_size=(14, 14)),
    "visionttt_base": _cfg(pool_size=(14, 14)),
    "visionttt_h_tiny": _cfg(),
    "visionttt_h_small": _cfg(),
    "visionttt_h_base": _cfg(),
    "visionttt_tiny_la": _cfg(pool_size=(14, 14)),
    "visionttt_small_la": _cfg(pool_size=(14, 14)),
    "visionttt_base_la": _cfg(pool_size=(14, 14)),
    "visionttt_h_tiny_la": _cfg(),
    "visionttt_h_small_la": _cfg(),
    "visionttt_h_base_la": _cfg(),
})

# the plain linear-attention Vision-TTT ("TTT with KV Binding Is Secretly Linear Attention"): TTT-Linear with a
# dot-product inner loss and no inner LayerNorm, an exact chunk-parallel linear attention (mixer option)
_LA = dict(inner_loss="dot")


def _la_kwargs(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    if kwargs.get("mixer", "ttt_linear") != "ttt_linear":
        raise ValueError(f"visionttt_*_la is the 'ttt_linear' mixer with inner_loss='dot'; got mixer="
                         f"{kwargs['mixer']!r} (build visionttt_* for another mixer)")
    return dict(kwargs, mixer_kwargs=dict(_LA, **(kwargs.get("mixer_kwargs") or {})))


def _visionttt(variant: str, size: str, pretrained: bool, kwargs: Dict[str, Any]) -> VisionTTT:
    return _create(VisionTTT, variant, pretrained, 3, **dict(VISIONTTT_SIZES[size], **kwargs))


def _visionttt_h(variant: str, size: str, pretrained: bool, kwargs: Dict[str, Any]) -> VisionTTTH:
    return _create(VisionTTTH, variant, pretrained, (0, 1, 2, 3), **dict(VISIONTTT_H_SIZES[size], **kwargs))


@register_model
def visionttt_tiny(pretrained: bool = False, **kwargs) -> VisionTTT:
    """Vittt-T: 5.91M params, 1.44 GFLOPs, 77.3% top-1 (paper). 3 heads of 64."""
    return _visionttt("visionttt_tiny", "tiny", pretrained, kwargs)


@register_model
def visionttt_small(pretrained: bool = False, **kwargs) -> VisionTTT:
    """Vittt-S: 22M params, 5.3 GFLOPs, 81.2% top-1 (paper)."""
    return _visionttt("visionttt_small", "small", pretrained, kwargs)


@register_model
def visionttt_base(pretrained: bool = False, **kwargs) -> VisionTTT:
    """Vittt-B: 87M params, 20.3 GFLOPs, 82.5% top-1 (paper)."""
    return _visionttt("visionttt_base", "base", pretrained, kwargs)


@register_model
def visionttt_h_tiny(pretrained: bool = False, **kwargs) -> VisionTTTH:
    """Vittt-H-T: 28M params, 5.6 GFLOPs, 82.6% top-1 (paper)."""
    return _visionttt_h("visionttt_h_tiny", "tiny", pretrained, kwargs)


@register_model
def visionttt_h_small(pretrained: bool = False, **kwargs) -> VisionTTTH:
    """Vittt-H-S: 50M params, 10.8 GFLOPs (paper)."""
    return _visionttt_h("visionttt_h_small", "small", pretrained, kwargs)


@register_model
def visionttt_h_base(pretrained: bool = False, **kwargs) -> VisionTTTH:
    """Vittt-H-B: 88M params, 18.8 GFLOPs (paper)."""
    return _visionttt_h("visionttt_h_base", "base", pretrained, kwargs)


@register_model
def visionttt_tiny_la(pretrained: bool = False, **kwargs) -> VisionTTT:
    """Vittt-T with the plain linear-attention inner loop (dot-product loss, no inner LayerNorm)."""
    return _visionttt("visionttt_tiny_la", "tiny", pretrained, _la_kwargs(kwargs))


@register_model
def visionttt_small_la(pretrained: bool = False, **kwargs) -> VisionTTT:
    """Vittt-S, linear-attention inner loop."""
    return _visionttt("visionttt_small_la", "small", pretrained, _la_kwargs(kwargs))


@register_model
def visionttt_base_la(pretrained: bool = False, **kwargs) -> VisionTTT:
    """Vittt-B, linear-attention inner loop."""
    return _visionttt("visionttt_base_la", "base", pretrained, _la_kwargs(kwargs))


@register_model
def visionttt_h_tiny_la(pretrained: bool = False, **kwargs) -> VisionTTTH:
    """Vittt-H-T, linear-attention inner loop."""
    return _visionttt_h("visionttt_h_tiny_la", "tiny", pretrained, _la_kwargs(kwargs))


@register_model
def visionttt_h_small_la(pretrained: bool = False, **kwargs) -> VisionTTTH:
    """Vittt-H-S, linear-attention inner loop."""
    return _visionttt_h("visionttt_h_small_la", "small", pretrained, _la_kwargs(kwargs))


@register_model
def visionttt_h_base_la(pretrained: bool = False, **kwargs) -> VisionTTTH:
    """Vittt-H-B, linear-attention inner loop."""
    return _visionttt_h("visionttt_h_base_la", "base", pretrained, _la_kwargs(kwargs))
