"""``SD3T5Transformer2DModel``: diffusers' SD3 transformer with TTT layers chosen by its config (SD3.5-T5).

A subclass registered through the config, so ``save_pretrained`` / ``from_pretrained`` and
``DiffusionPipeline.from_pretrained`` (``model_index.json`` names this module) persist it in diffusers' own format.
``from_pretrained`` of a softmax SD3 folder converts it (every pretrained tensor inherited; only ``*.ttt.*`` new).

Layer choice (config ``ttt_dual_layers`` / ``ttt_joint_layers``; ``None`` = :func:`default_ttt_layers`):
SD3.5-Medium, the paper's "Dual (13) + Joint (last 5)": the image-only ``attn2`` of every dual-attention block and
the joint ``attn`` of the last 5 blocks.  Options the paper does not state (defaults and reasons in docs/sd3.md):
``ttt_key_norm_span`` ("joint"), ``ttt_rms_qk_norm`` ("keep"), ``ttt_key_norm_eps`` (1.0, DiT5's).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from diffusers.configuration_utils import register_to_config
# DiffusionPipeline.from_pretrained imports the module named in model_index.json (this one) and finds the loading
# method by looking up its base classes *in this module's namespace*: ModelMixin must be importable from here.
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from .attention import KEY_NORM_SPANS, RMS_QK_NORM_MODES, SD3TTTAttention, SD3TTTAttnProcessor, TTTProcessorError

__all__ = ["SD3T5Transformer2DModel", "default_ttt_layers", "PAPER_JOINT_LAYERS", "SOFTMAX_CLASS", "TTT_CLASS",
           "SD3LayoutError"]

#: the paper's joint-attention TTT layers in SD3.5-Medium: the last 5 blocks
PAPER_JOINT_LAYERS = 5
SOFTMAX_CLASS = "SD3Transformer2DModel"
TTT_CLASS = "SD3T5Transformer2DModel"


class SD3LayoutError(ValueError):
    """A checkpoint whose tensors do not match the TTT layout its config (or the caller) asks for."""


def default_ttt_layers(num_layers: int, dual_attention_layers: Sequence[int]) -> Tuple[List[int], List[int]]:
    """``(dual, joint)``: with dual-attention blocks (SD3.5-Medium) the paper's layout, all of their ``attn2`` +
    the joint ``attn`` of the last 5 blocks; without (SD3.5-Large, SD3.0) the joint ``attn`` of the last half
    of the blocks (the paper's "about half of the attention", not a layout the paper trained)."""
    dual = sorted(int(i) for i in dual_attention_layers)
    if dual:
        return dual, list(range(max(num_layers - PAPER_JOINT_LAYERS, 0), num_layers))
    return [], list(range(num_layers - num_layers // 2, num_layers))


def _check_layers(name: str, layers: Sequence[int], valid: Sequence[int], what: str) -> List[int]:
    out = [int(i) for i in layers]
    bad = [i for i in out if i not in valid]
    if bad:
        raise ValueError(f"{name}: layer index {bad[0]} is out of range; {what} ({list(valid) or 'none'}).")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} lists a layer twice: {out}.")
    return sorted(out)


class SD3T5Transformer2DModel(SD3Transformer2DModel):
    """SD3 / SD3.5 MMDiT with test-time-training layers (SD3.5-T5, arXiv 2605.02772 §5.3).

    Extra config (besides :class:`SD3Transformer2DModel`'s):
        ttt_dual_layers: blocks whose image-only ``attn2`` becomes TTT (must be dual-attention blocks).
        ttt_joint_layers: blocks whose joint text-image ``attn`` becomes TTT.
        ttt_key_norm_span: ``"joint"`` (default) or ``"separate"``: key instance-norm statistics over image and text
            keys together, or per stream, in joint TTT layers.
        ttt_rms_qk_norm: ``"keep"`` (default) or ``"skip"``: whether TTT layers apply SD3.5's RMS q/k norms before
            the key instance-norm.
        ttt_key_norm_eps: epsilon of the key instance-norm (1.0 as in DiT5).
    The resolved layer lists are written back to the config, so a saved folder always states its layout.
    """

    @register_to_config
    def __init__(self, sample_size: int = 128, patch_size: int = 2, in_channels: int = 16, num_layers: int = 18,
                 attention_head_dim: int = 64, num_attention_heads: int = 18, joint_attention_dim: int = 4096,
                 caption_projection_dim: int = 1152, pooled_projection_dim: int = 2048, out_channels: int = 16,
                 pos_embed_max_size: int = 96, dual_attention_layers: Tuple[int, ...] = (),
                 qk_norm: Optional[str] = None, ttt_dual_layers: Optional[Sequence[int]] = None,
                 ttt_joint_layers: Optional[Sequence[int]] = None, ttt_key_norm_span: str = "joint",
                 ttt_rms_qk_norm: str = "keep", ttt_key_norm_eps: float = 1.0):
        super().__init__(sample_size=sample_size, patch_size=patch_size, in_channels=in_channels,
                         num_layers=num_layers, attention_head_dim=attention_head_dim,
                         num_attention_heads=num_attention_heads, joint_attention_dim=joint_attention_dim,
                         caption_projection_dim=caption_projection_dim, pooled_projection_dim=pooled_projection_dim,
                         out_channels=out_channels, pos_embed_max_size=pos_embed_max_size,
                         dual_attention_layers=dual_attention_layers, qk_norm=qk_norm)
        if ttt_key_norm_span not in KEY_NORM_SPANS:
            raise ValueError(f"ttt_key_norm_span must be one of {KEY_NORM_SPANS}, got {ttt_key_norm_span!r}.")
        if ttt_rms_qk_norm not in RMS_QK_NORM_MODES:
            raise ValueError(f"ttt_rms_qk_norm must be one of {RMS_QK_NORM_MODES}, got {ttt_rms_qk_norm!r}.")
        d_dual, d_joint = default_ttt_layers(num_layers, dual_attention_layers)
        dual = _check_layers("ttt_dual_layers", d_dual if ttt_dual_layers is None else ttt_dual_layers,
                             sorted(dual_attention_layers), "attn2 exists only in the dual-attention blocks")
        joint = _check_layers("ttt_joint_layers", d_joint if ttt_joint_layers is None else ttt_joint_layers,
                              range(num_layers), f"the model has {num_layers} blocks (0..{num_layers - 1})")
        if not dual and not joint:
            raise ValueError("No TTT layers chosen (ttt_dual_layers and ttt_joint_layers are both empty).")
        self.register_to_config(ttt_dual_layers=dual, ttt_joint_layers=joint)
        opts = dict(key_norm_span=ttt_key_norm_span, key_norm_eps=ttt_key_norm_eps, rms_qk_norm=ttt_rms_qk_norm)
        for i in dual:
            blk = self.transformer_blocks[i]
            blk.attn2 = self._ttt_like(blk.attn2, joint=False, **opts)
        for i in joint:
            blk = self.transformer_blocks[i]
            blk.attn = self._ttt_like(blk.attn, joint=True, **opts)

    def _ttt_like(self, attn: nn.Module, joint: bool, **opts) -> SD3TTTAttention:
        """A TTT layer with exactly the tensors of the softmax ``attn`` it replaces (+ ``ttt.*``)."""
        cfg = self.config
        new = SD3TTTAttention(query_dim=attn.query_dim, cross_attention_dim=None,
                              added_kv_proj_dim=attn.added_kv_proj_dim if joint else None,
                              dim_head=cfg.attention_head_dim, heads=attn.heads, out_dim=attn.out_dim,
                              context_pre_only=attn.context_pre_only if joint else None, bias=True,
                              qk_norm=cfg.qk_norm, eps=1e-6, **opts)
        old_sd = {k: v.shape for k, v in attn.state_dict().items()}
        new_sd = {k: v.shape for k, v in new.state_dict().items() if not k.startswith("ttt.")}
        if old_sd != new_sd:  # a diffusers version that builds its attention differently
            raise RuntimeError(f"SD3.5-T5 TTT layer does not match the softmax attention it replaces: "
                               f"{sorted(set(old_sd) ^ set(new_sd))[:6]}")
        return new.to(device=attn.to_q.weight.device, dtype=attn.to_q.weight.dtype)

    # ----- what is new --------------------------------------------------------------------------------------------
    def ttt_modules(self) -> Iterator[Tuple[str, SD3TTTAttention]]:
        for name, m in self.named_modules():
            if isinstance(m, SD3TTTAttention):
                yield name, m

    def new_parameter_names(self) -> List[str]:
        """Names of the parameters that a softmax SD3 checkpoint does not have (everything under ``.ttt.``)."""
        return [f"{n}.ttt.{p}" for n, m in self.ttt_modules() for p, _ in m.ttt.named_parameters()]

    def init_new_parameters(self) -> List[str]:
        """Materialise and initialise TTT parameters left on the meta device (``from_pretrained`` with
        ``low_cpu_mem_usage=True`` under accelerate does that for tensors missing from the checkpoint).  Returns
        the names it initialised."""
        done = []
        for name, m in self.ttt_modules():
            if any(p.device.type == "meta" for p in m.ttt.parameters()):
                ref = m.to_q.weight
                if ref.device.type == "meta":
                    raise RuntimeError(f"{name}.to_q is still on the meta device: load the pretrained weights first.")
                m.ttt.to_empty(device=ref.device).to(dtype=ref.dtype)
                m.ttt.reset_parameters()
                done += [f"{name}.ttt.{p}" for p, _ in m.ttt.named_parameters()]
        return done

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's spelling (the ttt-zoo trainer's ``--grad-checkpointing``) of diffusers' gradient checkpointing."""
        (self.enable_gradient_checkpointing if enable else self.disable_gradient_checkpointing)()

    # ----- guards -------------------------------------------------------------------------------------------------
    def set_attn_processor(self, processor) -> None:
        names = [n + ".processor" for n, _ in self.ttt_modules()]
        if not isinstance(processor, dict):
            raise TTTProcessorError(
                f"set_attn_processor({type(processor).__name__}) would replace the {len(names)} TTT layers of this "
                f"SD3.5-T5 model with softmax attention. Pass a dict that keeps their processors, e.g. "
                f"{{**{{k: new for k in model.attn_processors}}, **{{k: model.attn_processors[k] for k in "
                f"model.ttt_processor_names()}}}}.")
        bad = [n for n in names if not isinstance(processor.get(n), SD3TTTAttnProcessor)]
        if bad:
            raise TTTProcessorError(f"set_attn_processor would replace the TTT layers {bad[:3]} with softmax "
                                    f"attention; keep their SD3TTTAttnProcessor.")
        super().set_attn_processor(processor)

    def ttt_processor_names(self) -> List[str]:
        return [n + ".processor" for n, _ in self.ttt_modules()]

    def fuse_qkv_projections(self):
        raise TTTProcessorError("fuse_qkv_projections() would replace the TTT layers of this SD3.5-T5 model with "
                                "softmax attention (FusedJointAttnProcessor2_0); it is not supported.")

    # ----- forward ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _feat_size(self, feat_size: Tuple[int, int]):
        """Give every TTT layer the image grid; under gradient checkpointing also when a block is recomputed in the
        backward (the checkpointed function sets it again, so another forward in between cannot change it)."""
        layers = [m for _, m in self.ttt_modules()]

        def set_grid():
            for m in layers:
                m.ttt.feat_size = feat_size

        set_grid()
        orig = self._gradient_checkpointing_func
        if self.gradient_checkpointing and orig is not None:
            def run(block, *args):
                def with_grid(*a):
                    set_grid()
                    return block(*a)
                return orig(with_grid, *args)
            self._gradient_checkpointing_func = run
        try:
            yield
        finally:
            self._gradient_checkpointing_func = orig

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """:meth:`SD3Transformer2DModel.forward`, with the latent grid (H/p, W/p) passed to the TTT layers."""
        h, w = hidden_states.shape[-2:]
        p, cap = self.config.patch_size, self.config.pos_embed_max_size
        if h % p or w % p:
            raise ValueError(f"Latent size {h}x{w} is not a multiple of the patch size {p}.")
        if cap is not None and (h > cap * p or w > cap * p):
            raise ValueError(f"Latent size {h}x{w} is larger than pos_embed_max_size * patch_size = {cap * p} per "
                             f"side (the position embedding covers {cap}x{cap} patches); use a smaller image.")
        with self._feat_size((h // p, w // p)):
            return super().forward(hidden_states, *args, **kwargs)

    # ----- loading ------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Load an SD3.5-T5 folder, or convert a softmax SD3 folder (``ttt_*`` keyword arguments choose the layout).

        Raises :class:`SD3LayoutError` when the folder is not an SD3 transformer, or its tensors do not match the
        TTT layout (a TTT checkpoint loaded with other ``ttt_*`` layers, or missing / extra tensors).
        """
        cfg_keys = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
        config = cls.load_config(pretrained_model_name_or_path, **{k: kwargs[k] for k in cfg_keys if k in kwargs})
        source = config.get("_class_name")
        if source not in (SOFTMAX_CLASS, TTT_CLASS):
            raise SD3LayoutError(f"{pretrained_model_name_or_path} holds a {source!r}, not an SD3 transformer "
                                 f"({SOFTMAX_CLASS} or {TTT_CLASS}). For a pipeline folder pass "
                                 f"subfolder='transformer'.")
        want_info = kwargs.pop("output_loading_info", False)
        log = logging.getLogger("diffusers.models.modeling_utils")
        level = log.level
        if source == SOFTMAX_CLASS:  # the new TTT tensors are missing by design: no "newly initialized" warning
            log.setLevel(logging.ERROR)
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, output_loading_info=True, **kwargs)
        finally:
            log.setLevel(level)
        new = set(model.new_parameter_names())
        missing, unexpected = set(info["missing_keys"]), set(info["unexpected_keys"])
        allowed_missing = new if source == SOFTMAX_CLASS else set()
        if missing - allowed_missing or unexpected or info["mismatched_keys"]:
            raise SD3LayoutError(
                f"{pretrained_model_name_or_path} does not match the TTT layout "
                f"(dual {model.config.ttt_dual_layers}, joint {model.config.ttt_joint_layers}): tensors missing "
                f"{sorted(missing - allowed_missing)[:4]}, unexpected {sorted(unexpected)[:4]}, mismatched "
                f"{[m[0] for m in info['mismatched_keys']][:4]}. Load an SD3.5-T5 folder with the layout of its own "
                f"config (no ttt_* arguments), or convert a softmax SD3 folder.")
        model.init_new_parameters()
        return (model, info) if want_info else model
