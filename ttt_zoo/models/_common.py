"""Helpers shared by the model files: input validation, building (checkpoints: :mod:`ttt_zoo.checkpoint`)."""

import contextlib
import inspect
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import is_exportable, register_notrace_function, trunc_normal_
from timm.models import build_model_with_cfg, checkpoint
from timm.models._features import feature_take_indices

# checkpoint loading lives in ttt_zoo.checkpoint; re-exported for the model files' checkpoint_filter_fn
from ttt_zoo.layers.mixer import check_kwargs
from ttt_zoo.checkpoint import (HUB_ORG, SAFE_GLOBALS, CheckpointError, default_filter_fn, load_checkpoint_file,
                                resolve_pretrained, safe_torch_load, unwrap_checkpoint, validate_state_dict,
                                with_hub_ids)

__all__ = ["check_image", "unwrap_checkpoint", "validate_state_dict", "build_ttt_model", "CheckpointError",
           "safe_torch_load", "drop_path_schedule", "load_checkpoint_file", "factory_device", "HUB_ORG",
           "with_hub_ids", "image_cfg", "init_weights", "reset_inner_parameters", "check_global_pool", "check_sizes",
           "TTTClassifier", "run_blocks"]


@register_notrace_function
def check_image(x: torch.Tensor, in_chans: int, multiple: int, min_size: int, model_name: str) -> None:
    """Raise a clear error for an input the model cannot take (TorchScript- and fx-compatible)."""
    # the shape string is built only on an error: str() of a symbolic size breaks a torch.compile(dynamic=True) graph
    if not x.is_floating_point():
        raise TypeError(
            model_name + " expects a floating-point image batch, got an integer/bool tensor (shape "
            + str(list(x.shape)) + "). Convert it first, e.g. x.float() / 255 then normalise with the model's mean and std (or use "
            + "timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))).")
    if x.dim() != 4:
        raise ValueError(model_name + " expects a 4-D image batch (B, C, H, W), got shape " + str(list(x.shape)) + ".")
    if x.shape[1] != in_chans:
        raise ValueError(
            model_name + " was built for " + str(in_chans) + " input channels but got " + str(x.shape[1])
            + " (shape " + str(list(x.shape)) + "). Convert the images (e.g. RGB for 3 channels) or build the model with in_chans="
            + str(x.shape[1]) + ".")
    h, w = x.shape[-2], x.shape[-1]
    if h < min_size or w < min_size:
        raise ValueError(model_name + " needs images of at least " + str(min_size) + "x" + str(min_size)
                         + " pixels, got " + str(h) + "x" + str(w) + ". Resize or pad the input.")
    if multiple > 1 and (h % multiple != 0 or w % multiple != 0):
        fix_h = (h + multiple - 1) // multiple * multiple
        fix_w = (w + multiple - 1) // multiple * multiple
        raise ValueError(
            model_name + " needs height and width divisible by its patch size " + str(multiple) + ", got "
            + str(h) + "x" + str(w) + ". Resize or pad to e.g. " + str(fix_h) + "x" + str(fix_w) + ".")


#: what timm's create_model / build_model_with_cfg and this builder take besides the model's own arguments
_BUILD_KWARGS = tuple(n for n in inspect.signature(build_model_with_cfg).parameters
                      if n not in ("kwargs", "model_cls", "variant", "pretrained")) + (
    "pruned", "features_only", "out_indices", "feature_cls", "device", "dtype")


def build_ttt_model(model_cls, variant: str, pretrained: bool, default_out_indices: Any = None,
                    **kwargs) -> nn.Module:
    """``build_model_with_cfg`` plus safe loading of official checkpoints (no arbitrary pickles).

    ``default_out_indices``: for backbones, the ``features_only`` outputs (timm's getter over
    ``forward_intermediates``) unless the caller passes ``out_indices``."""
    # a misspelled option raises (naming it and the accepted ones) instead of building the default model
    check_kwargs(f"{variant} ({model_cls.__name__})", model_cls, kwargs, extra=_BUILD_KWARGS)
    if default_out_indices is not None:
        out_indices = kwargs.pop("out_indices", default_out_indices)
        kwargs["feature_cfg"] = dict(out_indices=out_indices, feature_cls="getter")
    if pretrained:
        kwargs.setdefault("pretrained_filter_fn", default_filter_fn)
        resolve_pretrained(variant, kwargs)
    # timm's create_model(device=, dtype=): build in place on the device, then cast
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    with torch.serialization.safe_globals(SAFE_GLOBALS), factory_device(device):
        try:
            model = build_model_with_cfg(model_cls, variant, pretrained, **kwargs)
            for m in model.modules():  # timm keeps the cfg: do not keep the loaded checkpoint alive with it
                cfg = getattr(m, "pretrained_cfg", None)
                if isinstance(cfg, dict):
                    cfg.pop("state_dict", None)
                if is_exportable() and hasattr(m, "recompute_act"):  # timm's exportable=True: the MLPs keep their
                    m.recompute_act = False  # activations (an autograd.Function stops TorchScript's ONNX exporter)
            return model.to(dtype=dtype) if dtype is not None else model
        except Exception as e:  # noqa: BLE001 - only safetensors read errors are rewritten
            if type(e).__name__ != "SafetensorError":
                raise
            raise CheckpointError(
                f"The pretrained weights of {variant} could not be read ({e}). The model.safetensors file is "
                f"truncated or corrupt: delete it (from the local folder or the Hugging Face cache) and download "
                f"or convert it again (`ttt-zoo convert`).") from e


def image_cfg(url: str = "", *, pool_size: Tuple[int, int], crop_pct: float, first_conv: str,
              **kwargs) -> Dict[str, Any]:
    """timm's pretrained cfg of our ImageNet-1k classifiers (224 px, bicubic, any input size); ``kwargs``: the
    paper's ``paper_ids`` / ``paper_name`` / ``origin_url`` and any other field."""
    return {
        "url": url, "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": pool_size,
        "crop_pct": crop_pct, "interpolation": "bicubic", "fixed_input_size": False,
        "mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD,
        "first_conv": first_conv, "classifier": "head", "license": "apache-2.0", **kwargs,
    }


def factory_device(device: Optional[Union[str, torch.device]]):
    """Context that creates parameters directly on ``device`` (timm passes ``device=``/``dtype=`` to constructors)."""
    return torch.device(device) if device is not None else contextlib.nullcontext()


def drop_path_schedule(rate: float, depth: int) -> List[float]:
    """Stochastic-depth rates rising linearly 0 -> rate over ``depth`` blocks (no tensors: meta-device safe)."""
    return [rate * i / (depth - 1) if depth > 1 else 0.0 for i in range(depth)]


def run_blocks(blocks: Iterable[nn.Module], x: torch.Tensor, *args: Any, grad_checkpointing: bool = False
               ) -> torch.Tensor:
    """``x = blk(x, *args)`` for each block (``args``: the feature size, DiT's conditioning); with
    ``grad_checkpointing`` each block runs under timm's ``checkpoint`` (timm's ``use_reentrant`` default, False), so
    its activations are recomputed in the backward.  Eager only: TorchScript callers loop over the blocks
    themselves (the one runner of every family; timm's ``checkpoint_seq`` takes blocks of one argument only)."""
    for blk in blocks:
        x = checkpoint(blk, x, *args) if grad_checkpointing else blk(x, *args)
    return x


def init_weights(m: nn.Module) -> None:
    """Every Linear (head included) trunc_normal(.02) / zero bias; LayerNorm 1/0; convs keep PyTorch's init."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def reset_inner_parameters(model: nn.Module) -> None:
    """(Re-)initialise the TTT inner parameters of every mixer in ``model`` (after ``model.apply(init_weights)``)."""
    for m in model.modules():
        if hasattr(m, "reset_inner_parameters"):
            m.reset_inner_parameters()


#: the smallest value of each size argument the families take (a list of them: every stage's)
_SIZE_MIN = dict(depth=1, depths=1, num_heads=1, embed_dim=1, hidden_size=1, head_dim=1, num_classes=0)
_SIZE_WHAT = dict(depth="blocks", depths="blocks per stage", num_heads="attention heads", embed_dim="width",
                  hidden_size="width", head_dim="width of a head", num_classes="classes; 0: no classifier")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_sizes(model_name: str, **sizes: Any) -> None:
    """The one check of the families' size arguments (``depth``/``depths``, ``num_heads``, ``embed_dim``/
    ``hidden_size``, ``head_dim``, ``num_classes``; a list: one per stage), run by every constructor before it
    builds anything: a ValueError naming the argument, e.g. ``depth=-1`` or ``num_heads=0``, and a width that its
    heads do not divide (per stage)."""
    for name, v in sizes.items():
        lo = _SIZE_MIN[name]
        items = list(v) if isinstance(v, (list, tuple)) else [v]
        if not items or not all(_is_int(x) and x >= lo for x in items):
            kind = "a list of integers" if isinstance(v, (list, tuple)) else "an integer"
            why = ("is empty" if not items else "is out of range" if all(_is_int(x) for x in items)
                   else f"is not {kind}")
            raise ValueError(f"{model_name}: {name}={v!r} {why}; give {kind} >= {lo} ({_SIZE_WHAT[name]})")
    width = sizes.get("embed_dim", sizes.get("hidden_size"))
    heads = sizes.get("num_heads")
    if width is None or heads is None:
        return
    arg = "embed_dim" if "embed_dim" in sizes else "hidden_size"
    pairs = zip(*(x if isinstance(x, (list, tuple)) else [x] for x in (width, heads)))
    for w, h in pairs:
        if w % h:
            fits = sorted(sorted((d for d in range(1, w + 1) if w % d == 0), key=lambda d: abs(d - h))[:2])
            raise ValueError(f"{model_name}: {arg} {w} is not divisible by num_heads {h} ({arg}={width!r}, "
                             f"num_heads={heads!r}); give num_heads dividing it, e.g. "
                             f"{' or '.join(map(str, fits))}")


def check_global_pool(global_pool: str, model_name: str = "") -> None:
    if global_pool not in ("avg", ""):
        where = f" for {model_name}" if model_name else ""
        raise ValueError(f"global_pool must be 'avg' or ''{where}, got {global_pool!r}")


class TTTClassifier(nn.Module):
    """The classifier part every image family shares: mean pool (``global_pool='avg'``) or none (``''``, per-location
    logits), dropout, Linear ``head`` over ``num_features``; features are NHWC or NCHW per ``output_fmt``.

    Subclasses build their trunk, then call :meth:`init_head`; ``forward_features`` and ``forward`` are theirs:
    ``forward`` must live in the module whose globals hold the ``register_notrace_function`` helpers the trace
    meets (torch.fx autowraps only the traced ``forward``'s module globals).
    """

    #: the ModuleList of stages that ``forward_intermediates`` indexes: ``blocks`` (plain) or ``layers``
    stages_attr: str = "layers"
    #: the ``output_fmt`` s ``forward_intermediates`` accepts
    intermediate_fmts: Tuple[str, ...] = ("NCHW",)

    def __init__(self, num_classes: int, global_pool: str, in_chans: int, display_name: str = ""):
        super().__init__()
        self.model_name = type(self).__name__
        check_sizes(display_name or self.model_name, num_classes=num_classes)
        check_global_pool(global_pool, display_name or self.model_name)
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.in_chans = in_chans
        self.output_fmt = "NCHW"

    def init_head(self, num_features: int, drop_rate: float) -> None:
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(num_features, self.num_classes) if self.num_classes > 0 else nn.Identity()

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        check_sizes(self.model_name, num_classes=num_classes)
        self.num_classes = num_classes
        if global_pool is not None:
            check_global_pool(global_pool)
            self.global_pool = global_pool
        ref = next(self.parameters())  # the stem's weight: the new head's device and dtype
        self.head = (nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype)
                     if num_classes > 0 else nn.Identity())
        self.head.train(self.training)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        nhwc = self.output_fmt == "NHWC"
        if self.global_pool == "avg":
            x = x.mean(dim=(1, 2)) if nhwc else x.mean(dim=(2, 3))
        x = self.head_drop(x)
        if pre_logits:
            return x
        if self.global_pool == "" and not nhwc:  # no pooling: per-location logits, NCHW
            return self.head(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(x)

    # ----- timm feature API (the families walk their stages in ``_intermediates``) -----
    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """The outputs of the stages (plain models: blocks) picked by ``indices``, laid out as ``output_fmt``, and
        unless ``intermediates_only`` the final normalised features (as ``forward_features``)."""
        if output_fmt not in self.intermediate_fmts:
            raise ValueError(f"{self.model_name} returns intermediates as {' or '.join(self.intermediate_fmts)}, "
                             f"got output_fmt={output_fmt!r}")
        num_stages = len(getattr(self, self.stages_attr))
        take_indices, max_index = feature_take_indices(num_stages, indices)
        last = max_index + 1 if stop_early else num_stages
        return self._intermediates(x, take_indices, last, norm, output_fmt, intermediates_only)

    def _intermediates(self, x: torch.Tensor, take_indices: List[int], last: int, norm: bool, output_fmt: str,
                       intermediates_only: bool) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        raise NotImplementedError

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> List[int]:
        stages = getattr(self, self.stages_attr)
        take_indices, max_index = feature_take_indices(len(stages), indices)
        setattr(self, self.stages_attr, stages[:max_index + 1])
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices
