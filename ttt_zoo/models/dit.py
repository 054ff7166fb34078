"""DiT: the class-conditional latent diffusion transformer, with the token mixer as a choice.

"Scalable Diffusion Models with Transformers" (Peebles & Xie, arXiv 2212.09748).  One skeleton serves three
families, which differ only in the mixer and the CPE:

- ``dit_*``  (this file): softmax attention, the ORIGINAL DiT key layout, so DiT checkpoints load;
- ``dit3_*`` (``dit3.py``): the ViT3 TTT mixer plus a depthwise-conv CPE before each block (DiT^3);
- ``dit5_*`` (``dit5.py``): half TTT, half neighbourhood attention (DiT5, linearised from a softmax DiT).

Conventions kept from the official code: x_embedder -> + fixed 2-D sin-cos pos_embed -> blocks with adaLN-Zero
modulation from c = t_emb + y_emb -> final adaLN layer -> unpatchify.  Extensions: any latent size the patch size
divides, non-square included (the sin-cos table is computed for the runtime grid), and float64.
"""

import math
from functools import partial
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import PatchEmbed, register_notrace_function
from timm.models import checkpoint, generate_default_cfgs, register_model

from ttt_zoo.errors import NoFeaturesError
from ttt_zoo.kernels.adaln import triton_path as adaln_triton_path
from ttt_zoo.kernels.backend import tracing
from ttt_zoo.layers import ResidualCPE, TokenMlp, create_mixer
from ttt_zoo.layers.block import _hooked
from ttt_zoo.layers.joint_linear import joint_linear
from ._common import (build_ttt_model, check_image, check_sizes, unwrap_checkpoint, validate_state_dict,
                      with_hub_ids)

__all__ = ["DiT", "DiTBlock", "timestep_embedding", "sincos_pos_embed_2d", "checkpoint_filter_fn", "DIT_SIZES",
           "ONE_BLOCK_KWARGS"]


# The aten path's adaLN glue.  ``addcmul`` saves a launch forward but its backward multiplies by its ``value`` (one
# launch more per factor): it serves inference, ``mul`` + ``add`` a step that records gradients.
def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 + scale) + shift`` per sample."""
    if torch.is_grad_enabled():
        return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
    return torch.addcmul(shift.unsqueeze(1), x, 1 + scale.unsqueeze(1))


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x + gate * y`` per sample."""
    if torch.is_grad_enabled():
        return x + gate.unsqueeze(1) * y
    return torch.addcmul(x, gate.unsqueeze(1), y)




def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B,) timesteps -> (B, dim) = [cos(t f_k), sin(t f_k)], f_k = max_period^(-k / (dim // 2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=dtype, device=t.device) / half)
    args = t[:, None].to(dtype) * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def sincos_pos_embed_2d(dim: int, feat_size: Tuple[int, int], dtype: torch.dtype = torch.float32,
                        device: Optional[torch.device] = None) -> torch.Tensor:
    """The DiT/MAE fixed table, (1, H*W, dim), raster order.  Token (r, c) gets channel blocks of width dim/4:
    [sin(c w_k), cos(c w_k), sin(r w_k), cos(r w_k)], w_k = 10000^(-k / (dim/4)) (column first, as official)."""
    if dim % 4:
        raise ValueError(f"the 2-D sin-cos position embedding needs a width divisible by 4, got {dim}")
    h, w = feat_size
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64, device=device) / (dim / 4))
    rows = torch.arange(h, dtype=torch.float64, device=device).repeat_interleave(w)[:, None] * omega
    cols = torch.arange(w, dtype=torch.float64, device=device).repeat(h)[:, None] * omega
    emb = torch.cat([cols.sin(), cols.cos(), rows.sin(), rows.cos()], dim=1)
    return emb.to(dtype).unsqueeze(0)


@register_notrace_function
def timestep_features(t: torch.Tensor, dim: int, weight: torch.Tensor) -> torch.Tensor:
    """The sinusoid in float64 for float64 weights, else in float32 (the official numbers), cast to the weights."""
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    return timestep_embedding(t, dim, dtype=dtype).to(weight.dtype)


@register_notrace_function
def runtime_pos_embed(pos_embed: torch.Tensor, grid_size: Tuple[int, int],
                       feat_size: Tuple[int, int]) -> torch.Tensor:
    """The stored table at the built size; a freshly computed one for any other grid."""
    if feat_size[0] == grid_size[0] and feat_size[1] == grid_size[1]:
        return pos_embed
    return sincos_pos_embed_2d(pos_embed.shape[-1], feat_size, pos_embed.dtype, pos_embed.device)


@register_notrace_function
def check_conditioning(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, num_labels: int,
                        model_name: str) -> None:
    b = x.shape[0]
    if t.dim() != 1 or t.shape[0] != b:
        raise ValueError(f"{model_name} expects t as a 1-D tensor of {b} timesteps (one per sample), "
                         f"got shape {tuple(t.shape)}. Use e.g. torch.full(({b},), t).")
    if y.dim() != 1 or y.shape[0] != b:
        raise ValueError(f"{model_name} expects y as a 1-D tensor of {b} class labels, got shape {tuple(y.shape)}.")
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"{model_name} expects integer class labels y, got dtype {y.dtype}. Use y.long().")
    # the label range needs the values (a graph break under torch.compile, where the compiled embedding's own
    # bounds check reports a bad label instead)
    if b and y.device.type != "meta" and not torch.compiler.is_compiling() and \
            (int(y.min()) < 0 or int(y.max()) >= num_labels):
        raise ValueError(f"{model_name} labels must lie in [0, {num_labels - 1}] "
                         f"({'the last one is the null class for guidance' if num_labels > 1 else ''}), "
                         f"got min {int(y.min())}, max {int(y.max())}.")


class TimestepEmbedder(nn.Module):
    """Sinusoid of t (256 features) -> Linear -> SiLU -> Linear.  Keys ``mlp.0``, ``mlp.2``.

    The sinusoid is computed in float64 for float64 models and in float32 otherwise (the official numbers)."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_features(t, self.frequency_embedding_size, self.mlp[0].weight))


class LabelEmbedder(nn.Module):
    """Class embedding with an extra null class (index ``num_classes``) when ``dropout_prob > 0``.

    In training, labels are replaced by the null class with probability ``dropout_prob`` (for guidance)."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def forward(self, labels: torch.Tensor, force_drop_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if force_drop_ids is not None:
            labels = torch.where(force_drop_ids == 1, self.num_classes, labels)
        elif self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels)


class DiTBlock(ResidualCPE, nn.Module):
    """[x += cpe(x)]; x += g1 * mixer(mod(LN x)); x += g2 * mlp(mod(LN x)) with adaLN-Zero (6 vectors from c).

    The CPE (DiT3) sits before and outside the gate.  Keys: ``cpe``, ``attn`` (the mixer), ``mlp.fc1/fc2``,
    ``adaLN_modulation.1``; the LayerNorms have no affine parameters.
    """

    def __init__(self, dim: int, num_heads: int, mixer: str = "softmax", cpe: bool = False, mlp_ratio: float = 4.0,
                 mixer_kwargs: Optional[Dict[str, Any]] = None):
        super().__init__()
        self.cpe = nn.Conv2d(dim, dim, 3, padding=1, groups=dim) if cpe else None
        self.backend: Optional[str] = (mixer_kwargs or {}).get("backend")  # the CPE's kernel follows the mixer's
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = create_mixer(mixer, dim, num_heads=num_heads, qkv_bias=True, **(mixer_kwargs or {}))
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = TokenMlp(dim, int(dim * mlp_ratio), act_layer=partial(nn.GELU, approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor, feat_size: Tuple[int, int],
                mod: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """``mod``: the six (B, C) modulation vectors the model computed for all its blocks at once
        (:meth:`DiT.modulations`); None: from ``c`` through this block's ``adaLN_modulation``."""
        if self.cpe is not None:
            x = self._cpe(x, feat_size)
        if mod is None:
            mod = self.adaLN_modulation(c).chunk(6, dim=1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod[0], mod[1], mod[2], mod[3], mod[4], mod[5]
        if not torch.jit.is_scripting():
            fused = adaln_triton_path(x, self.backend)  # the adaLN kernels: 3 launches of glue, where aten's are 9
            if fused is not None and not (_hooked(self.norm1) or _hooked(self.norm2)):
                y = self.attn(fused.modulate_norm(x, shift1, scale1, self.norm1.eps), feat_size)
                x, h = fused.gate_residual_modulate_norm(x, y, gate1, shift2, scale2, self.norm2.eps)
                return fused.gate_residual(x, self.mlp(h, feat_size), gate2)
        x = gated_residual(x, self.attn(modulate(self.norm1(x), shift1, scale1), feat_size), gate1)
        return gated_residual(x, self.mlp(modulate(self.norm2(x), shift2, scale2), feat_size), gate2)


class FinalLayer(nn.Module):
    """adaLN (shift, scale) -> LN -> Linear to p*p*out_channels per token."""

    def __init__(self, dim: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor, mod: Optional[List[torch.Tensor]] = None,
                backend: Optional[str] = None) -> torch.Tensor:
        if mod is None:
            mod = self.adaLN_modulation(c).chunk(2, dim=1)
        shift, scale = mod[0], mod[1]
        if not torch.jit.is_scripting():
            fused = adaln_triton_path(x, backend)
            if fused is not None and not _hooked(self.norm_final):
                return self.linear(fused.modulate_norm(x, shift, scale, self.norm_final.eps))
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Class-conditional diffusion transformer: ``forward(x, t, y)`` predicts eps (and the variance if
    ``learn_sigma``) for latents ``x`` (B, in_chans, H, W) at timesteps ``t`` (B,) with labels ``y`` (B,).

    Args:
        input_size: latent size the model is built for (the stored ``pos_embed``); other sizes work too.
        patch_size: latent patch size (2, 4 or 8 in the released configs).
        in_chans: latent channels (4 for the SD VAE).
        hidden_size, depth, num_heads, mlp_ratio: transformer size.
        class_dropout_prob: label dropout for classifier-free guidance (adds the null class when > 0).
        num_classes: number of classes (the null class is index ``num_classes``).
        learn_sigma: also predict the variance (output channels 2 * in_chans).
        mixer: token mixer name (``'softmax'``, ``'vit3'``, ``'dit5_mixed'``, any registered mixer).
        cpe: residual depthwise 3x3 conv position encoding before each block (DiT3).
        mixer_kwargs: extra keyword arguments for the mixer.
    """

    def __init__(
            self,
            input_size: Union[int, Tuple[int, int]] = 32,
            patch_size: int = 2,
            in_chans: int = 4,
            hidden_size: int = 1152,
            depth: int = 28,
            num_heads: int = 16,
            mlp_ratio: float = 4.0,
            class_dropout_prob: float = 0.1,
            num_classes: int = 1000,
            learn_sigma: bool = True,
            mixer: str = "softmax",
            cpe: bool = False,
            mixer_kwargs: Optional[Dict[str, Any]] = None,
    ):
        super().__init__()
        check_sizes(type(self).__name__, hidden_size=hidden_size, depth=depth, num_heads=num_heads,
                    num_classes=num_classes)
        self.in_chans = in_chans
        self.out_channels = in_chans * 2 if learn_sigma else in_chans
        self.learn_sigma = learn_sigma
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.hidden_size = self.embed_dim = hidden_size
        self.mixer = mixer
        self.grad_checkpointing = False

        self.x_embedder = PatchEmbed(input_size, patch_size, in_chans, hidden_size, flatten=False,
                                     output_fmt="NHWC", strict_img_size=False)
        self.grid_size: Tuple[int, int] = tuple(self.x_embedder.grid_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        self.pos_embed = nn.Parameter(sincos_pos_embed_2d(hidden_size, self.grid_size), requires_grad=False)
        self.blocks = nn.ModuleList([
            DiTBlock(hidden_size, num_heads, mixer=mixer, cpe=cpe, mlp_ratio=mlp_ratio, mixer_kwargs=mixer_kwargs)
            for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """The official init: xavier Linear / zero bias, patch conv as a Linear, N(0, .02) label table and
        t-MLP weights, zero adaLN and output layers (a fresh model outputs 0).  Mixer-internal parameters
        (TTT inner weights, convs) keep the mixer's own init."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        w = self.x_embedder.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for layer in [blk.adaLN_modulation[-1] for blk in self.blocks] + [self.final_layer.adaLN_modulation[-1],
                                                                          self.final_layer.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    # ----- timm-style API -----
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {"pos_embed"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r"^(?:x_embedder|t_embedder|y_embedder|pos_embed)",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^final_layer", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    # ----- forward -----
    def unpatchify(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        """(B, h*w, p*p*C) -> (B, C, h*p, w*p); each token's vector is laid out (p, p, C)."""
        h, w = feat_size
        p, c = self.patch_size, self.out_channels
        x = x.reshape(x.shape[0], h, w, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(x.shape[0], c, h * p, w * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (B, in_chans, H, W), t (B,) timesteps (may be fractional), y (B,) int labels -> (B, out_channels, H, W)."""
        check_image(x, self.in_chans, self.patch_size, self.patch_size, "DiT")
        if not torch.jit.is_scripting():
            check_conditioning(x, t, y, self.y_embedder.embedding_table.num_embeddings, "DiT")
        # timm's PatchEmbed.forward without its size assert (check_image validated the size; the assert's f-string,
        # built on every call, made torch.compile(dynamic=True) specialise the size); the tokens a buffer, not a view
        # of the conv output (inductor cannot order a view's symbolic strides)
        x = self.x_embedder.proj(x)
        feat_size = (x.shape[2], x.shape[3])
        x = self.x_embedder.norm(x.flatten(2).transpose(1, 2).contiguous())  # B, h*w, D
        x = x + runtime_pos_embed(self.pos_embed, self.grid_size, feat_size)
        c = self.t_embedder(t) + self.y_embedder(y)
        if torch.jit.is_scripting():  # no checkpointing, each block's own adaLN GEMM
            for blk in self.blocks:
                x = blk(x, c, feat_size)
            x = self.final_layer(x, c)
        else:
            mods = self.modulations(c)
            for blk, mod in zip(self.blocks, mods[:-1]):
                x = checkpoint(blk, x, c, feat_size, mod) if self.grad_checkpointing else blk(x, c, feat_size, mod)
            x = self.final_layer(x, c, mods[-1], self.blocks[0].backend)
        return self.unpatchify(x, feat_size)

    @torch.jit.unused
    def modulations(self, c: torch.Tensor) -> List[Optional[List[torch.Tensor]]]:
        """Every block's six adaLN vectors and the final layer's two, from one SiLU of ``c`` and one GEMM over all
        the ``adaLN_modulation`` Linears (their parameters kept apart: :func:`~ttt_zoo.layers.joint_linear`), cut
        by one ``unbind``: per model 3 launches forward and 5 backward, where each block's own SiLU, GEMM and
        ``chunk`` launch 2 and 5.  Graph capture (torch.fx, compile, export) and hooks on those Linears get
        ``None`` per block: each runs its own."""
        layers = [blk.adaLN_modulation for blk in self.blocks] + [self.final_layer.adaLN_modulation]
        if isinstance(c, torch.fx.Proxy) or tracing() or any(_hooked(m) or _hooked(m[1]) for m in layers):
            return [None] * len(layers)
        joined = joint_linear(F.silu(c), [(m[1].weight, m[1].bias) for m in layers])
        vecs = joined.unflatten(1, (-1, c.shape[-1])).unbind(1)
        counts = [m[1].out_features // c.shape[-1] for m in layers]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [list(vecs[s:s + n]) for s, n in zip(starts, counts)]

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float,
                         guidance_channels: int = 3) -> torch.Tensor:
        """Classifier-free guidance, batched as in the official sampler.

        The batch is [conditional half; unconditional half] (labels y, then the null class); only the first half
        of ``x`` is used (duplicated).  Guidance eps = uncond + cfg_scale * (cond - uncond) is applied to the first
        ``guidance_channels`` output channels; the default 3 is the official quirk (kept for reproducibility),
        ``guidance_channels=in_chans`` is the standard recipe.  The rest (variance) is the model's own output.
        """
        if x.shape[0] % 2:
            raise ValueError(f"forward_with_cfg needs an even batch [conditional; unconditional], got {x.shape[0]}.")
        if not 0 < guidance_channels <= self.out_channels:
            raise ValueError(f"guidance_channels must be in [1, {self.out_channels}], got {guidance_channels}.")
        half = x[: x.shape[0] // 2]
        out = self.forward(torch.cat([half, half], dim=0), t, y)
        eps, rest = out[:, :guidance_channels], out[:, guidance_channels:]
        cond, uncond = torch.split(eps, eps.shape[0] // 2, dim=0)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([torch.cat([guided, guided], dim=0), rest], dim=1)


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: DiT) -> Dict[str, torch.Tensor]:
    """Load DiT-style checkpoints: ``{'model', 'ema', 'opt', 'args'}`` from ``train.py`` (the EMA weights are
    chosen, as the official sampler does), the original DiT release (a bare EMA state dict) or ours.

    ``pos_embed`` is a fixed sin-cos table: when the model is built for another ``input_size`` its own table is
    kept instead of failing on the shape."""
    sd = unwrap_checkpoint(state_dict, prefer_ema=True)
    own = model.state_dict()
    if "pos_embed" in sd and "pos_embed" in own and sd["pos_embed"].shape != own["pos_embed"].shape:
        sd["pos_embed"] = own["pos_embed"].clone()
    validate_state_dict(sd, model, ignore_prefixes=())
    return sd


def refuse_features_only(variant: str, kwargs: Dict[str, Any]) -> None:
    """A DiT-skeleton model (dit, dit3, dit5) has no feature maps (timm's FeatureListNet would fail on its missing ``feature_info``):
    ``features_only`` raises one clear :class:`~ttt_zoo.errors.NoFeaturesError` before anything is built."""
    if kwargs.get("features_only"):
        raise NoFeaturesError(
            f"{variant} has no features_only: DiT, DiT3 and DiT5 are diffusion models (forward(x, t, y) returns the "
            f"denoiser output) and have no feature maps or forward_features; create it without features_only, and "
            f"for a block's tokens register a forward hook on model.blocks[i]; features_only is for the image "
            f"backbones (vit3_*, hvit3_*, visionttt_*)")


def create_dit(variant: str, pretrained: bool = False, **kwargs) -> DiT:
    """Build any DiT-skeleton model through timm (shared by dit, dit3 and dit5)."""
    refuse_features_only(variant, kwargs)
    return build_ttt_model(DiT, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                           feature_cfg=None, **kwargs)


def dit_cfg(url: str = "", input_size: int = 32, **kwargs) -> Dict[str, Any]:
    return {
        "url": url, "num_classes": 1000, "input_size": (4, input_size, input_size), "pool_size": None,
        "fixed_input_size": False, "mean": (0.0,) * 4, "std": (1.0,) * 4, "interpolation": "",
        "crop_pct": 1.0, "first_conv": "x_embedder.proj", "classifier": None, "license": "cc-by-nc-4.0",
        "paper_ids": "arXiv:2212.09748", "paper_name": "Scalable Diffusion Models with Transformers",
        "origin_url": "https://github.com/facebookresearch/DiT", **kwargs,
    }


#: the DiT sizes (one table for the three DiT-skeleton families: dit, dit3, dit5; the patch size is in the name)
DIT_SIZES = {
    "s": dict(depth=12, hidden_size=384, num_heads=6),
    "b": dict(depth=12, hidden_size=768, num_heads=12),
    "l": dict(depth=24, hidden_size=1024, num_heads=16),
    "xl": dict(depth=28, hidden_size=1152, num_heads=16),
}
#: family -> the overrides that shrink its smallest model to one block (the same block code; the compile checks)
ONE_BLOCK_KWARGS = {"dit": dict(depth=1)}


def dit_args(size: str, patch_size: int) -> Dict[str, Any]:
    """The registered arguments of the ``{size}_{patch_size}`` model of a DiT-skeleton family."""
    return dict(DIT_SIZES[size], patch_size=patch_size)


_FAIR = "https://dl.fbaipublicfiles.com/DiT/models/{}"

default_cfgs = generate_default_cfgs(with_hub_ids({
    "dit_xl_2.in1k_256": dit_cfg(url=_FAIR.format("DiT-XL-2-256x256.pt")),
    "dit_xl_2.in1k_512": dit_cfg(url=_FAIR.format("DiT-XL-2-512x512.pt"), input_size=64),
    # the softmax DiT-S/2 the DiT5 authors linearise from (Transformer-to-TTT README)
    "dit_s_2.t2t_256": dit_cfg(url="https://cloud.tsinghua.edu.cn/f/ce8c6a6f96dc4d17aa80/?dl=1"),
    "dit_xl_4": dit_cfg(), "dit_xl_8": dit_cfg(),
    "dit_l_2": dit_cfg(), "dit_l_4": dit_cfg(), "dit_l_8": dit_cfg(),
    "dit_b_2": dit_cfg(), "dit_b_4": dit_cfg(), "dit_b_8": dit_cfg(),
    "dit_s_4": dit_cfg(), "dit_s_8": dit_cfg(),
}))


def _dit(size: str, patch: int, pretrained: bool, kwargs: Dict[str, Any]) -> DiT:
    args = dict(dit_args(size, patch), mixer="softmax")
    return create_dit(f"dit_{size}_{patch}", pretrained, **dict(args, **kwargs))


@register_model
def dit_s_2(pretrained: bool = False, **kwargs) -> DiT:
    """DiT-S/2 (softmax attention); the DiT5 authors' linearisation source."""
    return _dit("s", 2, pretrained, kwargs)


@register_model
def dit_s_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("s", 4, pretrained, kwargs)


@register_model
def dit_s_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("s", 8, pretrained, kwargs)


@register_model
def dit_b_2(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("b", 2, pretrained, kwargs)


@register_model
def dit_b_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("b", 4, pretrained, kwargs)


@register_model
def dit_b_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("b", 8, pretrained, kwargs)


@register_model
def dit_l_2(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("l", 2, pretrained, kwargs)


@register_model
def dit_l_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("l", 4, pretrained, kwargs)


@register_model
def dit_l_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("l", 8, pretrained, kwargs)


@register_model
def dit_xl_2(pretrained: bool = False, **kwargs) -> DiT:
    """DiT-XL/2: FID 2.27 (cfg 1.5, 256px) in the DiT paper; original weights at 256 and 512 (input_size 64)."""
    return _dit("xl", 2, pretrained, kwargs)


@register_model
def dit_xl_4(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("xl", 4, pretrained, kwargs)


@register_model
def dit_xl_8(pretrained: bool = False, **kwargs) -> DiT:
    return _dit("xl", 8, pretrained, kwargs)
