"""Helpers shared by the model files: input validation, checkpoint unwrapping and validation, building."""

import argparse
import contextlib
import os
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Union

import torch
from torch import nn
from timm.layers import register_notrace_function, trunc_normal_
from timm.models import build_model_with_cfg

__all__ = ["check_image", "unwrap_checkpoint", "validate_state_dict", "build_ttt_model", "CheckpointError",
           "safe_torch_load", "drop_path_schedule", "load_checkpoint_file", "factory_device", "HUB_ORG",
           "with_hub_ids", "init_weights", "reset_inner_parameters", "check_global_pool", "TTTClassifier"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the requested model."""


@register_notrace_function
def check_image(x: torch.Tensor, in_chans: int, multiple: int, min_size: int, model_name: str) -> None:
    """Raise a clear error for an input the model cannot take (TorchScript- and fx-compatible)."""
    shape = str(list(x.shape))
    if not x.is_floating_point():
        raise TypeError(
            model_name + " expects a floating-point image batch, got an integer/bool tensor (shape " + shape
            + "). Convert it first, e.g. x.float() / 255 then normalise with the model's mean and std (or use "
            + "timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))).")
    if x.dim() != 4:
        raise ValueError(model_name + " expects a 4-D image batch (B, C, H, W), got shape " + shape + ".")
    if x.shape[1] != in_chans:
        raise ValueError(
            model_name + " was built for " + str(in_chans) + " input channels but got " + str(x.shape[1])
            + " (shape " + shape + "). Convert the images (e.g. RGB for 3 channels) or build the model with in_chans="
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


# Official checkpoints carry their training config: a yacs ``CfgNode`` (ViT3 'config') or an ``argparse.Namespace``
# (DiT 'args').  The weights-only unpickler may build them as inert containers: CfgNode (a dict subclass) becomes an
# OrderedDict, Namespace stays a Namespace.  No other class and no callable is allowed.
_SAFE_STUBS = [(OrderedDict, "yacs.config.CfgNode"), (argparse.Namespace, "argparse.Namespace")]


def safe_torch_load(path: str, map_location: str = "cpu") -> Any:
    """``torch.load(weights_only=True)`` that also accepts the config objects official checkpoints carry.

    Only tensors, plain containers and the inert stubs above are ever constructed; no code runs.
    """
    try:
        with torch.serialization.safe_globals(_SAFE_STUBS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise CheckpointError(
            f"Could not read checkpoint {path!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            f"It may be truncated or corrupt (download it again), or hold objects other than tensors "
            f"(re-save its state_dict, or convert it with `ttt-zoo convert`).") from e


_NESTED_KEYS = ("state_dict_ema", "model_ema", "ema", "state_dict", "model", "module")


def unwrap_checkpoint(checkpoint: Dict[str, Any], prefer_ema: bool = True) -> Dict[str, torch.Tensor]:
    """Return the tensor dict from the layouts training scripts write.

    ``{'model': ...}`` (official ViT3 / H-ViT3), ``{'state_dict_ema': ...}`` (H-ViT3 ``main_ema.py``; chosen first
    when ``prefer_ema``: the released H-ViT3 results are those of the EMA-trained runs), ``{'state_dict': ...}``
    (mmengine), ``{'ema': ...}`` (DiT), or a bare state dict.  A ``module.`` prefix (DDP) is stripped.
    """
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"Expected a dict checkpoint, got {type(checkpoint).__name__}.")
    order = _NESTED_KEYS if prefer_ema else tuple(k for k in _NESTED_KEYS if "ema" not in k) + ("state_dict_ema", "model_ema", "ema")
    sd = checkpoint
    for key in order:
        if isinstance(checkpoint.get(key), dict) and checkpoint[key]:
            sd = checkpoint[key]
            break
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        out[k[len("module."):] if k.startswith("module.") else k] = v
    if not out:
        raise CheckpointError(f"No tensors found in checkpoint (top-level keys: {sorted(checkpoint)[:10]}).")
    return out


def validate_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module,
                        ignore_prefixes: Iterable[str] = ("head.",)) -> None:
    """Raise :class:`CheckpointError` naming every missing, unexpected or mis-shaped key.

    Keys under ``ignore_prefixes`` (the classifier, which timm adapts to ``num_classes``) are not checked.
    """
    ignore = tuple(ignore_prefixes)
    own = {k: v for k, v in model.state_dict().items() if not k.startswith(ignore)}
    theirs = {k: v for k, v in state_dict.items() if not k.startswith(ignore)}
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    mismatched = [f"{k}: checkpoint {tuple(theirs[k].shape)} vs model {tuple(own[k].shape)}"
                  for k in own if k in theirs and tuple(theirs[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or mismatched:
        name = getattr(model, "pretrained_cfg", {}).get("architecture", type(model).__name__)
        lines = [f"Checkpoint does not fit model {name!r}."]
        if mismatched:
            lines.append(f"{len(mismatched)} shape mismatches (is it for another model size?): " + "; ".join(mismatched[:5]))
        if missing:
            lines.append(f"{len(missing)} missing keys: {missing[:5]}")
        if unexpected:
            lines.append(f"{len(unexpected)} unexpected keys: {unexpected[:5]}")
        lines.append("Build the model that matches the checkpoint (see `ttt-zoo list`), or convert it with `ttt-zoo convert`.")
        raise CheckpointError(" ".join(lines))


def load_checkpoint_file(path: str) -> Dict[str, Any]:
    """Read a ``.safetensors`` or torch checkpoint safely, with a clear error for missing or corrupt files."""
    if not os.path.isfile(path):
        raise CheckpointError(f"Checkpoint file {path!r} does not exist.")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        try:
            return load_file(path, device="cpu")
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"Could not read safetensors file {path!r}: {e}. It is truncated or corrupt; "
                                  f"download or convert it again.") from e
    return safe_torch_load(path)


def _resolve_local_weights(variant: str, kwargs: Dict[str, Any]) -> None:
    """Route file and URL weights through :func:`load_checkpoint_file` (safe, clear errors) as a state-dict overlay.

    Official URLs (cloud.tsinghua.edu.cn/f/<id>/?dl=1) carry no file name, which timm's URL cache needs, so they are
    downloaded to ``<torch hub>/checkpoints/ttt_zoo/<model>.<tag>.pth`` here.
    """
    from urllib.parse import urlparse
    from timm.models._builder import resolve_pretrained_cfg
    overlay = dict(kwargs.get("pretrained_cfg_overlay") or {})
    pc = resolve_pretrained_cfg(variant, pretrained_cfg=kwargs.get("pretrained_cfg"), pretrained_cfg_overlay=overlay)
    if pc is None or pc.state_dict or pc.source:
        return
    path = pc.file
    if not path and pc.url and not pc.hf_hub_id and not os.path.basename(urlparse(pc.url).path):
        cache = os.path.join(torch.hub.get_dir(), "checkpoints", "ttt_zoo")
        path = os.path.join(cache, f"{pc.architecture}.{pc.tag or 'default'}.pth")
        if not os.path.exists(path):
            os.makedirs(cache, exist_ok=True)
            tmp = path + ".partial"
            torch.hub.download_url_to_file(pc.url, tmp, progress=True)
            os.replace(tmp, path)
    if path:
        overlay.pop("file", None)
        overlay["state_dict"] = load_checkpoint_file(path)
        kwargs["pretrained_cfg_overlay"] = overlay


# ----- Hugging Face Hub ids with the authors' URL as fallback (docs/hub.md) -----

#: Hub organisation of converted ttt-zoo weights; repos are named ``<model>.<tag>`` like timm's own.
HUB_ORG = "ttt-zoo"


def with_hub_ids(cfgs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Give every cfg with released weights (a ``url``) the hub id ``ttt-zoo/<model>.<tag>``.

    Use as ``generate_default_cfgs(with_hub_ids({...}))``.  Until a repo is uploaded the ``url`` is used
    (see :func:`_resolve_hub_weights`)."""
    return {name: dict(cfg, hf_hub_id=cfg.get("hf_hub_id") or f"{HUB_ORG}/{name}") if cfg.get("url") else cfg
            for name, cfg in cfgs.items()}


def _hub_has_weights(hub_id: str, filename: Optional[str], cache_dir: Optional[str]) -> bool:
    """True when the repo's weights can be fetched (online) or are cached (offline)."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError
    except ImportError:
        return False
    repo, _, revision = hub_id.partition("@")
    try:
        hf_hub_download(repo, filename or "model.safetensors", revision=revision or None, cache_dir=cache_dir)
        return True
    except (EntryNotFoundError, HfHubHTTPError, OSError, ValueError):
        # not uploaded (RepositoryNotFound / EntryNotFound), offline without a cached copy
        # (LocalEntryNotFound), no network (OSError)
        return False


def _resolve_hub_weights(variant: str, kwargs: Dict[str, Any]) -> None:
    """timm loads from ``hf_hub_id`` whenever huggingface_hub is installed, even if the repo does not exist.
    When the repo cannot be reached, drop the hub id so the authors' ``url`` is used instead."""
    from timm.models._builder import resolve_pretrained_cfg
    pc = resolve_pretrained_cfg(variant, pretrained_cfg=kwargs.get("pretrained_cfg"),
                                pretrained_cfg_overlay=kwargs.get("pretrained_cfg_overlay"))
    if pc is None or pc.source or pc.file or pc.state_dict or not pc.hf_hub_id or not pc.url:
        return
    if _hub_has_weights(pc.hf_hub_id, pc.hf_hub_filename, kwargs.get("cache_dir")):
        return
    import logging
    logging.getLogger(__name__).info("%s is not on the Hugging Face Hub (or not cached offline); using %s",
                                     pc.hf_hub_id, pc.url)
    kwargs["pretrained_cfg_overlay"] = dict(kwargs.get("pretrained_cfg_overlay") or {}, hf_hub_id=None)


def build_ttt_model(model_cls, variant: str, pretrained: bool, default_out_indices: Any = None,
                    **kwargs) -> nn.Module:
    """``build_model_with_cfg`` plus safe loading of official checkpoints (no arbitrary pickles).

    ``default_out_indices``: for backbones, the ``features_only`` outputs (timm's getter over
    ``forward_intermediates``) unless the caller passes ``out_indices``."""
    if default_out_indices is not None:
        out_indices = kwargs.pop("out_indices", default_out_indices)
        kwargs["feature_cfg"] = dict(out_indices=out_indices, feature_cls="getter")
    if pretrained:
        _resolve_hub_weights(variant, kwargs)
        _resolve_local_weights(variant, kwargs)
    # timm's create_model(device=, dtype=): build in place on the device, then cast
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    with torch.serialization.safe_globals(_SAFE_STUBS), factory_device(device):
        try:
            model = build_model_with_cfg(model_cls, variant, pretrained, **kwargs)
            return model.to(dtype=dtype) if dtype is not None else model
        except Exception as e:  # noqa: BLE001 - only safetensors read errors are rewritten
            if type(e).__name__ != "SafetensorError":
                raise
            raise CheckpointError(
                f"The pretrained weights of {variant} could not be read ({e}). The model.safetensors file is "
                f"truncated or corrupt: delete it (from the local folder or the Hugging Face cache) and download "
                f"or convert it again (`ttt-zoo convert`).") from e


def factory_device(device: Optional[Union[str, torch.device]]):
    """Context that creates parameters directly on ``device`` (timm passes ``device=``/``dtype=`` to constructors)."""
    return torch.device(device) if device is not None else contextlib.nullcontext()


def drop_path_schedule(rate: float, depth: int) -> List[float]:
    """Stochastic-depth rates rising linearly 0 -> rate over ``depth`` blocks (no tensors: meta-device safe)."""
    return [rate * i / (depth - 1) if depth > 1 else 0.0 for i in range(depth)]


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

    def __init__(self, num_classes: int, global_pool: str, in_chans: int, display_name: str = ""):
        super().__init__()
        self.model_name = type(self).__name__
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
