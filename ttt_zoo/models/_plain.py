"""The plain (one-stride) TTT ViT shared by ViT3, T5 and Vision-TTT.

Patch embedding [+ learned position embedding] -> ``TTTBlock`` s -> LayerNorm -> mean pool -> head, with timm's model
API.  The families differ only in the constructor arguments (mixer and its kwargs, CPE or position embedding, MLP).
"""

import math
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from timm.layers import PatchEmbed, register_notrace_function, resample_abs_pos_embed, trunc_normal_

from ttt_zoo.layers import TTTBlock
from ._common import (CheckpointError, TTTClassifier, check_image, check_sizes, drop_path_schedule, init_weights,
                      reset_inner_parameters, run_blocks)

__all__ = ["PlainTTTViT", "resample_pos_embed", "fit_checkpoint_pos_embed"]


def _resample_eager(pos_embed: torch.Tensor, old_h: int, old_w: int, new_h: int, new_w: int) -> torch.Tensor:
    return resample_abs_pos_embed(pos_embed, new_size=[new_h, new_w], old_size=[old_h, old_w], num_prefix_tokens=0)


@torch.library.custom_op("ttt_zoo::resample_pos_embed", mutates_args=())
def _resample_op(pos_embed: torch.Tensor, old_h: int, old_w: int, new_h: int, new_w: int) -> torch.Tensor:
    out = _resample_eager(pos_embed, old_h, old_w, new_h, new_w)
    # contiguous, as the fake says; a custom op's output may not alias its input
    return out.clone() if out is pos_embed else out.contiguous()


@_resample_op.register_fake
def _(pos_embed, old_h, old_w, new_h, new_w):
    return pos_embed.new_empty(pos_embed.shape[0], new_h * new_w, pos_embed.shape[2])


@torch.library.custom_op("ttt_zoo::resample_pos_embed_bwd", mutates_args=())
def _resample_bwd_op(grad: torch.Tensor, pos_embed: torch.Tensor, old_h: int, old_w: int, new_h: int,
                     new_w: int) -> torch.Tensor:
    if old_h == new_h and old_w == new_w:  # resample_abs_pos_embed returns the embedding itself
        return grad.to(pos_embed.dtype).clone()
    c = pos_embed.shape[2]  # the backward of resample_abs_pos_embed's float32 bicubic antialiased interpolation
    g = grad.float().reshape(1, new_h, new_w, c).permute(0, 3, 1, 2).contiguous()
    g = torch.ops.aten._upsample_bicubic2d_aa_backward(g, [new_h, new_w], [1, c, old_h, old_w], False, None, None)
    return g.permute(0, 2, 3, 1).reshape(1, old_h * old_w, c).to(pos_embed.dtype).contiguous()


@_resample_bwd_op.register_fake
def _(grad, pos_embed, old_h, old_w, new_h, new_w):
    return torch.empty_like(pos_embed, memory_format=torch.contiguous_format)


def _resample_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.sizes = inputs[1:]


def _resample_backward(ctx, grad):
    return (_resample_bwd_op(grad.contiguous(), ctx.saved_tensors[0], *ctx.sizes), None, None, None, None)


_resample_op.register_autograd(_resample_backward, setup_context=_resample_setup)


def _bicubic_aa_onnx(g, x, output_size, align_corners, *scales):
    """TorchScript's ONNX exporter has no symbolic for the antialiased bicubic resize of the position embedding:
    ONNX Resize (opset 18) with the settings of onnxscript's, which the dynamo exporter uses (Keys a = -0.5,
    out-of-bounds taps dropped and renormalised, as PyTorch's antialias kernel)."""
    from torch.onnx import symbolic_helper as sh
    if sh._is_packed_list(output_size):  # traced sizes: one value per axis
        output_size = g.op("Concat", *[sh._unsqueeze_helper(g, v, [0]) for v in sh._unpack_list(output_size)],
                           axis_i=0)
    lead = g.op("Slice", g.op("Shape", x), g.op("Constant", value_t=torch.tensor([0])),
                g.op("Constant", value_t=torch.tensor([2])))
    sizes = g.op("Concat", lead, g.op("Cast", output_size, to_i=7), axis_i=0)  # 7: int64
    empty = g.op("Constant", value_t=torch.tensor([], dtype=torch.float32))
    mode = "align_corners" if sh._maybe_get_const(align_corners, "b") else "half_pixel"
    return g.op("Resize", x, empty, empty, sizes, mode_s="cubic", coordinate_transformation_mode_s=mode,
                cubic_coeff_a_f=-0.5, antialias_i=1, exclude_outside_i=1, nearest_mode_s="floor")


torch.onnx.register_custom_op_symbolic("aten::_upsample_bicubic2d_aa", _bicubic_aa_onnx, 18)


@register_notrace_function
def resample_pos_embed(pos_embed: torch.Tensor, grid_size: Tuple[int, int], feat_size: Tuple[int, int]) -> torch.Tensor:
    """(1, gh*gw, C) learned embedding -> (1, H*W, C) for the runtime map (bicubic, as timm's ViT)."""
    # no size-match early-out when exporting (as timm): it would fix the graph to the example input's size
    exporting = False
    if not torch.jit.is_scripting():  # TorchScript cannot compile torch.compiler.is_exporting
        exporting = torch.compiler.is_exporting() or torch.jit.is_tracing()
        if torch.compiler.is_compiling() and not exporting and not (
                grid_size[0] == feat_size[0] and grid_size[1] == feat_size[1]):
            # torch 2.14's antialiased bicubic backward has no meta kernel for symbolic sizes: under torch.compile
            # the resample is one opaque op, run eagerly at the concrete size
            return _resample_op(pos_embed, grid_size[0], grid_size[1], feat_size[0], feat_size[1])
    if not exporting and grid_size[0] == feat_size[0] and grid_size[1] == feat_size[1]:
        return pos_embed
    return resample_abs_pos_embed(pos_embed, new_size=[feat_size[0], feat_size[1]],
                                  old_size=[grid_size[0], grid_size[1]], num_prefix_tokens=0)


def fit_checkpoint_pos_embed(sd: Dict[str, Any], model: "PlainTTTViT") -> None:
    """Resample (in ``sd``) a checkpoint's (1, n, C) ``pos_embed`` of another square grid, optionally after one
    class-token slot (dropped), to the model's grid; a clear error when ``n`` is not such a grid."""
    pe = sd.get("pos_embed")
    if pe is None or pe.dim() != 3 or model.pos_embed is None or pe.shape[1] == model.pos_embed.shape[1]:
        return
    n = pe.shape[1]
    for prefix in (0, 1):
        side = math.isqrt(max(n - prefix, 0))
        if side > 0 and side * side == n - prefix:
            sd["pos_embed"] = resample_abs_pos_embed(pe[:, prefix:], new_size=list(model.grid_size),
                                                     old_size=[side, side], num_prefix_tokens=0)
            return
    raise CheckpointError(f"pos_embed with {n} tokens is not a square grid (+ optional class slot); cannot resample "
                          f"it to the model's {model.grid_size[0]}x{model.grid_size[1]} grid.")


class PlainTTTViT(TTTClassifier):
    """Patch embedding [+ pos_embed] -> TTT blocks -> LayerNorm -> mean pool -> head; features are (B, H, W, C).

    The families subclass it with their own defaults (mixer, heads, CPE or position embedding, MLP) and pass
    timm's usual arguments (``img_size``, ``patch_size``, ``in_chans``, ``num_classes``, ``global_pool``,
    ``embed_dim``, ``depth``, ``mlp_ratio``, ``qkv_bias``, drop rates) through as keyword arguments.

    Args (besides timm's usual ones):
        mixer, mixer_kwargs: the token mixer of every block (``ttt_zoo.layers.create_mixer``).
        cpe: residual depthwise-conv position encoding at the start of each block.
        pos_embed: learned absolute position embedding (resampled for other input sizes).
        mlp_layer: the blocks' MLP (default ``TokenMlp``).
        min_size: smallest input side (default ``patch_size``).
    """

    stages_attr = "blocks"
    intermediate_fmts = ("NCHW", "NLC")

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
            mixer: str = "vit3",
            mixer_kwargs: Optional[Dict[str, Any]] = None,
            cpe: bool = False,
            pos_embed: bool = False,
            drop_rate: float = 0.0,
            pos_drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
            mlp_layer: Optional[Callable[..., nn.Module]] = None,
            min_size: int = 0,
    ):
        super().__init__(num_classes, global_pool, in_chans)
        check_sizes(self.model_name, embed_dim=embed_dim, depth=depth, num_heads=num_heads)
        self.patch_size = patch_size
        self.min_size = max(min_size, patch_size)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        # forward_features is NHWC (timm's output_fmt, as Swin): the blocks work on channels-last tokens
        # (docs/models.md, "forward_features layout")
        self.output_fmt = "NHWC"
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, flatten=False, output_fmt="NHWC", strict_img_size=False)
        self.grid_size: Tuple[int, int] = (int(self.patch_embed.grid_size[0]), int(self.patch_embed.grid_size[1]))
        if pos_embed:
            self.pos_embed = nn.Parameter(torch.zeros(1, self.grid_size[0] * self.grid_size[1], embed_dim))
            self.pos_drop = nn.Dropout(pos_drop_rate)
        else:
            self.pos_embed = None
            self.pos_drop = None
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        dpr = drop_path_schedule(drop_path_rate, depth)
        self.blocks = nn.ModuleList([
            TTTBlock(embed_dim, num_heads, mixer=mixer, mlp_ratio=mlp_ratio, cpe=cpe, qkv_bias=qkv_bias,
                     proj_drop=proj_drop_rate, drop_path=dpr[i], norm_layer=norm_layer, mlp_layer=mlp_layer,
                     mixer_kwargs=mixer_kwargs)
            for i in range(depth)])
        self.feature_info = [dict(num_chs=embed_dim, reduction=patch_size, module=f"blocks.{i}") for i in range(depth)]
        self.norm = norm_layer(embed_dim)
        self.init_head(embed_dim, drop_rate)
        if self.pos_embed is not None:
            trunc_normal_(self.pos_embed, std=0.02)
        # official: every Linear (head included) trunc_normal(.02) / zero bias; LayerNorm 1/0; convs PyTorch default
        self.apply(init_weights)
        reset_inner_parameters(self)

    # ----- timm model API -----
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {"pos_embed"} if self.pos_embed is not None else set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        stem = r"^pos_embed|^patch_embed" if self.pos_embed is not None else r"^patch_embed"
        return dict(stem=stem, blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    # ----- forward -----
    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int]]:
        check_image(x, self.in_chans, self.patch_size, self.min_size, self.model_name)
        # timm's PatchEmbed.forward without its size assert (check_image validated the size; the assert's f-string,
        # built on every call, made torch.compile(dynamic=True) specialise the size); the tokens a buffer, not a view
        # of the conv output (inductor cannot order a view's symbolic strides)
        x = self.patch_embed.proj(x)
        feat_size = (x.shape[2], x.shape[3])
        x = self.patch_embed.norm(x.flatten(2).transpose(1, 2).contiguous())  # B, N, C
        if self.pos_embed is not None:
            x = x + resample_pos_embed(self.pos_embed, self.grid_size, feat_size)
        if self.pos_drop is not None:
            x = self.pos_drop(x)
        return x, feat_size

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the normalised (B, H, W, C) token map."""
        x, feat_size = self._embed(x)
        if torch.jit.is_scripting():  # no checkpointing in TorchScript
            for blk in self.blocks:
                x = blk(x, feat_size)
        else:
            x = run_blocks(self.blocks, x, feat_size, grad_checkpointing=self.grad_checkpointing)
        x = self.norm(x)
        return x.reshape(x.shape[0], feat_size[0], feat_size[1], x.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def _intermediates(self, x: torch.Tensor, take_indices: List[int], last: int, norm: bool, output_fmt: str,
                       intermediates_only: bool) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Block outputs at stride ``patch_size`` as (B, C, H, W) (``NCHW``) or (B, N, C) (``NLC``)."""
        x, feat_size = self._embed(x)
        b = x.shape[0]
        intermediates = []
        for i, blk in enumerate(self.blocks[:last]):
            x = run_blocks((blk,), x, feat_size, grad_checkpointing=self.grad_checkpointing)
            if i in take_indices:
                y = self.norm(x) if norm else x
                if output_fmt == "NCHW":
                    y = y.reshape(b, feat_size[0], feat_size[1], -1).permute(0, 3, 1, 2).contiguous()
                intermediates.append(y)
        if intermediates_only:
            return intermediates
        x = self.norm(x).reshape(b, feat_size[0], feat_size[1], -1)
        return x, intermediates
