"""Checkpoints: the one place ttt-zoo reads, unwraps, validates and resolves weights.

Glossary -- "checkpoint" is a weight file (this module; also the ``--checkpoint`` flag); a run folder's resumable
training state and its ``checkpoint.json`` epoch manifest are "run state" (:mod:`ttt_zoo.train.run_state`);
recomputing activations in the backward is "grad checkpointing" / recompute (:mod:`ttt_zoo.layers.recompute`).

Every layout is read without running code from the file: ``.safetensors`` with safetensors, anything else with
``torch.load(weights_only=True)`` (plus the inert config containers official checkpoints carry).  Layouts:
official ``{'model': ...}`` (ViT3 / H-ViT3 / T5), ``{'state_dict_ema': ...}`` / ``{'model_ema': ...}`` (EMA runs),
``{'ema': ...}`` (DiT), mmengine ``{'state_dict': ...}`` (with ``backbone.*`` keys for det/seg), ours (a bare
state dict or ``model.safetensors``).  Each model file's ``checkpoint_filter_fn`` (timm style) uses
:func:`unwrap_checkpoint` and :func:`validate_state_dict`; :func:`resolve_pretrained` turns a ``pretrained=True``
request into a state dict that timm's ``build_model_with_cfg`` / ``load_pretrained`` loads.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import struct
from collections import OrderedDict
from typing import Any, Dict, Iterable, Optional, Sequence

import torch
from torch import nn

from ttt_zoo.errors import CheckpointError  # noqa: F401  (re-exported)
from ttt_zoo.hub_format import HUB_ORG  # noqa: F401  (re-exported: the Hub organisation of converted weights)

__all__ = ["CheckpointError", "WeightsError", "safe_torch_load", "load_checkpoint_file", "unwrap_checkpoint", "mmengine_backbone",
           "default_filter_fn", "validate_state_dict", "check_finite", "check_dtypes", "damaged_weights",
           "check_safetensors",
           "resolve_pretrained",
           "hub_unavailable_error", "is_offline", "SAFE_GLOBALS", "HUB_ORG", "with_hub_ids"]

_logger = logging.getLogger(__name__)


class WeightsError(CheckpointError):
    """Weights that no model can use (NaN or an infinity, floats stored as integers): the file is damaged, so the
    message names the file and the tensor, never another model.  ``detail``: the message without the file."""

    def __init__(self, where: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.where, self.detail = where, detail

    def __reduce__(self):  # picklable (e.g. from a DataLoader worker)
        return type(self), (self.where, self.detail)


# ----- reading files -----

# Official checkpoints carry their training config: a yacs ``CfgNode`` (ViT3 'config') or an ``argparse.Namespace``
# (DiT 'args').  The weights-only unpickler may build them as inert containers: CfgNode (a dict subclass) becomes an
# OrderedDict, Namespace stays a Namespace.  No other class and no callable is allowed.
SAFE_GLOBALS = [(OrderedDict, "yacs.config.CfgNode"), (argparse.Namespace, "argparse.Namespace")]

_REDOWNLOAD = "Delete it and convert again (`ttt-zoo convert`) or download it again."


def _unpickle_reason(e: Exception) -> str:
    """The informative part of torch's weights-only error (never its 'weights_only=False' advice)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    advice = ("weights_only", "Re-running", "Weights only load failed", "Check the documentation", "Please file")
    line = next((ln.strip() for ln in text.splitlines() if ln.strip() and not any(a in ln for a in advice)),
                type(e).__name__)
    return line.split(" was not an allowed global")[0].split(". Please")[0]


def safe_torch_load(path: str, map_location: Any = "cpu", safe_globals: Sequence[Any] = ()) -> Any:
    """``torch.load(weights_only=True)`` that also accepts :data:`SAFE_GLOBALS` (and ``safe_globals``).

    Only tensors, plain containers and those inert types are ever constructed; no code from the file runs.
    Errors say whether the file is no checkpoint, truncated, or holds other objects."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch zip archive / legacy pickle
        raise CheckpointError(
            f"{path!r} is not a PyTorch checkpoint: it is neither a torch zip archive nor a pickle (it starts with "
            f"bytes {head!r}). Check that the path points at the weights file (.pth / .pt / .safetensors). "
            f"{_REDOWNLOAD}")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS + list(safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with what is wrong and how to fix it
        reason = _unpickle_reason(e)
        if "global" in reason.lower() or "not allowed" in reason:
            raise CheckpointError(
                f"Refusing to unpickle {path!r}: it holds Python objects other than tensors and plain data "
                f"({reason}); ttt-zoo reads checkpoints without running code from them. Re-save only its tensors "
                f"(torch.save(model.state_dict(), ...)) or convert it with `ttt-zoo convert`.") from e
        raise CheckpointError(f"Could not read checkpoint {path!r} ({reason}): the file is truncated or corrupt. "
                              f"{_REDOWNLOAD}") from e


def check_safetensors(path: str) -> int:
    """Check a safetensors header against the file size (reads the header only); explain truncation precisely.

    Returns the number of tensors the file holds."""
    size = os.path.getsize(path)
    if size < 8:
        raise CheckpointError(f"{path} is truncated or corrupt: a safetensors file needs a header, it holds only "
                              f"{size} bytes. {_REDOWNLOAD}")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise CheckpointError(f"{path} is truncated or corrupt: its safetensors header claims {n} bytes but "
                                  f"the file holds {size} bytes. {_REDOWNLOAD}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path} is corrupt: its safetensors header is not valid JSON ({e}). "
                                  f"{_REDOWNLOAD}") from e
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise CheckpointError(f"{path} is truncated or corrupt: its header lists {len(ends)} tensors needing {need} "
                              f"bytes but the file holds {size} bytes ({need - size} missing). {_REDOWNLOAD}")
    return len(ends)


def load_checkpoint_file(path: str, safe_globals: Sequence[Any] = ()) -> Dict[str, Any]:
    """Read any checkpoint file safely: ``.safetensors`` with safetensors, anything else with :func:`safe_torch_load`.

    Returns the file's top-level dict (unwrap it with :func:`unwrap_checkpoint`)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise CheckpointError(f"Checkpoint file {path!r} does not exist. Give the path of a .pth / .pt / "
                              f".safetensors file.")
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file
        check_safetensors(path)
        try:
            ckpt = load_file(path, device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise CheckpointError(f"{path} is truncated or corrupt ({type(e).__name__}: {e}). {_REDOWNLOAD}") from e
    else:
        ckpt = safe_torch_load(path, safe_globals=safe_globals)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"Checkpoint {path!r} holds a {type(ckpt).__name__}, not a dict of tensors. Save "
                              f"model.state_dict() instead of the model.")
    check_finite(ckpt, path)
    return ckpt


# ----- values: weights are checked where they enter (files here, every model load in validate_state_dict) -----

def _weights(checkpoint: Dict[str, Any]) -> Iterable[tuple]:
    """(name, tensor) of the weights a checkpoint carries: its top-level tensors and those of the state dicts
    :func:`unwrap_checkpoint` may pick (``model``, ``ema``, ...; an optimizer's state is not a weight)."""
    for k, v in checkpoint.items():
        if isinstance(v, torch.Tensor):
            yield k, v
        elif k in _NESTED_KEYS and isinstance(v, dict):
            yield from ((f"{k}.{n}", t) for n, t in _weights(v))


def check_finite(checkpoint: Dict[str, Any], where: str) -> None:
    """Refuse weights that hold NaN or an infinity: one :class:`CheckpointError` line naming ``where`` (the file),
    the first such tensor and how many there are."""
    bad = [(k, v) for k, v in _weights(checkpoint) if (v.is_floating_point() or v.is_complex())
           and v.device.type != "meta" and not bool(torch.isfinite(v).all())]
    if not bad:
        return
    k, v = bad[0]
    kind = "NaN" if bool(torch.isnan(v).any()) else "an infinity"
    n = int((~torch.isfinite(v)).sum())
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    raise WeightsError(where, f"tensor {k!r} holds {kind} ({n} of {v.numel()} values){more}; these weights are "
                              f"damaged or come from a diverged run: use an earlier checkpoint (a run's "
                              f"best.safetensors) or the original file.")


def check_dtypes(state_dict: Dict[str, torch.Tensor], model: nn.Module, where: str) -> None:
    """Refuse a tensor stored with a non-float dtype for a floating-point tensor of ``model`` (loading would cast
    it silently, e.g. int32 weights rounded to integers)."""
    own = model.state_dict()
    bad = [k for k, v in state_dict.items() if k in own and own[k].is_floating_point()
           and isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())]
    if bad:
        k = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise WeightsError(where, f"tensor {k!r} is stored as {str(state_dict[k].dtype)[6:]}, but the model's is "
                                  f"{str(own[k].dtype)[6:]}{more}; floating-point weights saved as integers have lost "
                                  f"their values: save the original weights again without casting them.")


def damaged_weights(e: Optional[BaseException], path: str) -> Optional[WeightsError]:
    """The :class:`WeightsError` behind ``e`` (itself or a wrapper's cause), naming ``path`` where it could not
    (a state dict handed over without its file), or None: for callers that reword "does not fit" errors."""
    while e is not None and not isinstance(e, WeightsError):
        e = e.__cause__
    if e is None:
        return None
    return WeightsError(path, e.detail) if e.where == _UNNAMED else e


_UNNAMED = "the checkpoint"


def _source(model: nn.Module) -> str:
    """The weights file a model's pretrained cfg names (for messages): a Hub folder's model.safetensors, the
    ``file`` that :func:`resolve_pretrained` read, a Hub repo; else 'the checkpoint'."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if cfg.get("source") == "local-dir" and cfg.get("file"):
        return os.path.join(cfg["file"], "model.safetensors")
    if cfg.get("source") == "hf-hub" and cfg.get("hf_hub_id"):
        return f"hf-hub:{cfg['hf_hub_id']}"
    return cfg.get("file") or _UNNAMED


# ----- layouts -----

_NESTED_KEYS = ("state_dict_ema", "model_ema", "ema", "state_dict", "model", "module")
_EMA_KEYS = ("state_dict_ema", "model_ema", "ema")


def unwrap_checkpoint(checkpoint: Dict[str, Any], prefer_ema: bool = True) -> Dict[str, torch.Tensor]:
    """Return the tensor dict from the layouts training scripts write.

    ``{'model': ...}`` (official ViT3 / H-ViT3), ``{'state_dict_ema': ...}`` / ``{'model_ema': ...}`` (chosen
    first when ``prefer_ema``: the released H-ViT3 results are those of the EMA-trained runs), ``{'state_dict': ...}``
    (mmengine), ``{'ema': ...}`` (DiT), or a bare state dict.  A ``module.`` prefix (DDP) is stripped.
    """
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"Expected a dict checkpoint, got {type(checkpoint).__name__}.")
    order = _NESTED_KEYS if prefer_ema else tuple(k for k in _NESTED_KEYS if k not in _EMA_KEYS) + _EMA_KEYS
    sd = next((checkpoint[k] for k in order if isinstance(checkpoint.get(k), dict) and checkpoint[k]), checkpoint)
    out = {k[len("module."):] if k.startswith("module.") else k: v
           for k, v in sd.items() if isinstance(v, torch.Tensor)}
    if not out:
        raise CheckpointError(f"No tensors found in checkpoint (top-level keys: {sorted(checkpoint)[:10]}).")
    return out


def default_filter_fn(state_dict: Dict[str, Any], model: nn.Module) -> Dict[str, torch.Tensor]:
    """``checkpoint_filter_fn`` of a model file that defines none: unwrap the layout, check the values, load as
    is."""
    sd = unwrap_checkpoint(state_dict)
    check_finite(sd, _source(model))
    check_dtypes(sd, model, _source(model))
    return sd


def mmengine_backbone(checkpoint: Dict[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
    """The ``backbone.*`` tensors (prefix removed) of an mmengine det/seg checkpoint, or None if it has none."""
    sd = checkpoint.get("state_dict") if isinstance(checkpoint.get("state_dict"), dict) else checkpoint
    keys = [k for k in sd if k.startswith("backbone.") and isinstance(sd[k], torch.Tensor)]
    return {k[len("backbone."):]: sd[k] for k in keys} if keys else None


def _classifier(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    cls = cfg.get("classifier", "head")
    return cls[0] if isinstance(cls, (list, tuple)) else cls


def _input_conv_shapes(model: nn.Module, own: Dict[str, torch.Tensor]) -> Dict[str, tuple]:
    """The checkpoint shape each first-conv weight must have when timm's ``load_pretrained`` adapts it (with
    ``timm.models.adapt_input_conv``, after the filter) from the cfg's ``input_size[0]`` to the model's
    ``in_chans``: the model's shape with the pretrained input channels (timm's own consistency rule)."""
    from timm.models import get_model_traits
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if not cfg.get("classifier"):  # a diffusion model: its in_chans are latent channels, also of its output layer
        return {}
    traits = get_model_traits(model)
    convs, in_chans = traits.get("first_conv", cfg.get("first_conv")), traits.get("in_chans")
    pretrained_in_chans = (cfg.get("input_size") or (3,))[0]
    if not convs or in_chans is None or in_chans == pretrained_in_chans:
        return {}
    shapes = {}
    for name in ((convs,) if isinstance(convs, str) else convs):
        w = own.get(f"{name}.weight")
        if w is not None and w.dim() == 4 and (w.shape[1] * pretrained_in_chans) % in_chans == 0:
            shapes[f"{name}.weight"] = (w.shape[0], w.shape[1] * pretrained_in_chans // in_chans, *w.shape[2:])
    return shapes


_TRANSPOSED = "Its classifier"


def _head_advice(theirs: Dict[str, torch.Tensor], own: Dict[str, torch.Tensor], cls_w: str) -> str:
    """What a classifier weight of another shape means: another number of classes, a transposed copy, or another
    width (a Linear's weight is (classes, features))."""
    (rows, cols), (classes, features) = theirs[cls_w].shape, own[cls_w].shape
    bias = theirs.get(cls_w[:-len("weight")] + "bias")
    if (rows, cols) == (features, classes) and (bias is None or tuple(bias.shape) == (classes,)):
        return (f"{_TRANSPOSED} {cls_w} is stored transposed: ({rows}, {cols}) where a Linear's weight is "
                f"(classes, features) = ({classes}, {features}); save it as weight.t() and load it again.")
    if cols == features:
        return (f"The checkpoint's classifier has {rows} classes and the model {classes}: build the model with "
                f"num_classes={rows} (or pass another num_classes to start a new classifier).")
    return (f"The checkpoint's classifier takes {cols} features and the model's {features}: it is for another "
            f"model size.")


def validate_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module,
                        ignore_prefixes: Iterable[str] = ("head.",), where: Optional[str] = None) -> None:
    """Raise :class:`CheckpointError` naming every missing, unexpected or mis-shaped key, a non-finite value or a
    float tensor stored as integers (``where``: the file, default the one the model's pretrained cfg names).

    Keys under ``ignore_prefixes`` (the classifier, which timm drops when ``num_classes`` differs from the
    pretrained cfg's) are only checked for shape when timm will load them.  The first conv (``first_conv`` of
    the cfg) of a model built with another ``in_chans`` is checked against the pretrained channels: timm adapts
    it after this check."""
    where = where or _source(model)
    check_finite(state_dict, where)
    ignore = tuple(ignore_prefixes)
    own, theirs = model.state_dict(), state_dict
    cfg = getattr(model, "pretrained_cfg", None) or {}
    head_loaded = cfg.get("num_classes") is not None and getattr(model, "num_classes", None) == cfg["num_classes"]
    checked = lambda k: not k.startswith(ignore) or head_loaded  # noqa: E731
    missing = sorted(k for k in own if k not in theirs and not k.startswith(ignore))
    unexpected = sorted(k for k in theirs if k not in own and not k.startswith(ignore))
    # a first conv may also come with the pretrained cfg's channels, which timm's load_pretrained adapts to the
    # model's in_chans after this check; a direct load of the model's own weights has the model's shape
    allowed = {k: {tuple(v.shape)} for k, v in own.items()}
    for k, shape in _input_conv_shapes(model, own).items():
        allowed[k].add(shape)
    bad = [k for k in own if k in theirs and checked(k) and tuple(theirs[k].shape) not in allowed[k]]
    if not (missing or unexpected or bad):
        check_dtypes({k: v for k, v in theirs.items() if checked(k)}, model, where)
        return
    name = cfg.get("architecture", type(model).__name__)
    lines = [f"Checkpoint does not fit model {name!r}."]
    if bad:
        shapes = "; ".join(f"{k}: checkpoint {tuple(theirs[k].shape)} vs model {tuple(own[k].shape)}" for k in bad[:5])
        cls_w = f"{_classifier(model)}.weight"
        head_only = cls_w in bad and theirs[cls_w].dim() == 2 and all(k.startswith(_classifier(model)) for k in bad)
        plural = "es" if len(bad) > 1 else ""
        lines.append(f"{len(bad)} shape mismatch{plural}{'' if head_only else ' (is it for another model size?)'}: "
                     f"{shapes}.")
        if head_only:
            lines.append(_head_advice(theirs, own, cls_w))
    if missing:
        lines.append(f"{len(missing)} missing keys: {missing[:5]}")
    if unexpected:
        lines.append(f"{len(unexpected)} unexpected keys: {unexpected[:5]}")
    if not lines[-1].startswith(_TRANSPOSED):  # a transposed head: the model is right, the file is not
        lines.append("Build the model that matches the checkpoint (see `ttt-zoo list`), or convert it with "
                     "`ttt-zoo convert`.")
    raise CheckpointError(" ".join(lines))


# ----- pretrained=True: Hugging Face Hub first, then the authors' URL, or a local file -----

def with_hub_ids(cfgs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Give every cfg with released weights (a ``url``) the hub id ``ttt-zoo/<model>.<tag>``.

    Use as ``generate_default_cfgs(with_hub_ids({...}))``.  Until a repo is uploaded the ``url`` is used."""
    return {name: dict(cfg, hf_hub_id=cfg.get("hf_hub_id") or f"{HUB_ORG}/{name}") if cfg.get("url") else cfg
            for name, cfg in cfgs.items()}


def is_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (the one switch for every download ttt-zoo makes)."""
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _hf_cache() -> str:
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def hub_unavailable_error(repo_id: str, what: str, err: Exception) -> CheckpointError:
    """The error for a Hub repo that cannot be fetched: which repo, where it was looked for, how to provide it."""
    where = f"the Hugging Face cache {_hf_cache()}"
    why = ("offline mode is on (HF_HUB_OFFLINE=1) and it is not in " + where if is_offline()
           else f"it could not be downloaded and is not in {where} ({type(err).__name__})")
    return CheckpointError(
        f"Could not load {what} from the Hugging Face Hub repo {repo_id!r}: {why}. Download it once online "
        f"(unset HF_HUB_OFFLINE), or load a local copy: a converted folder with 'local-dir:PATH', or a "
        f"checkpoint file with pretrained_cfg_overlay=dict(file='PATH').")


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
        # not uploaded, offline without a cached copy (LocalEntryNotFound), no network (OSError)
        return False


def _hub_weights_path(hub_id: str, filename: Optional[str], cache_dir: Optional[str]) -> Optional[str]:
    """Local path of a Hub repo's safetensors weights (downloaded if online); None if the repo has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
    repo, _, revision = hub_id.partition("@")
    filename = filename or "model.safetensors"
    if not filename.endswith(".safetensors"):
        return None
    try:
        return hf_hub_download(repo, filename, revision=revision or None, cache_dir=cache_dir)
    except LocalEntryNotFoundError as e:
        raise hub_unavailable_error(repo, filename, e) from e
    except EntryNotFoundError:
        return None  # another file layout: timm's own loader handles it
    except OSError as e:
        raise hub_unavailable_error(repo, filename, e) from e


def _download_official(pc, path: str) -> None:
    """Fetch the authors' file (their links carry no file name, which timm's URL cache needs) to ``path``."""
    looked = (f"{pc.architecture}.{pc.tag}: the Hugging Face Hub repo {pc.hf_hub_id!r} (not in the cache "
              f"{_hf_cache()}) and " if pc.hf_hub_id else f"{pc.architecture}.{pc.tag}: ")
    fix = (f"Put the authors' checkpoint ({pc.url}) at {path}, pass pretrained_cfg_overlay=dict(file='PATH') "
           f"for a checkpoint file, or load a converted folder with timm.create_model('local-dir:PATH', "
           f"pretrained=True).")
    if is_offline():
        raise CheckpointError(f"No pretrained weights found offline (HF_HUB_OFFLINE=1) for {looked}the authors' "
                              f"file {path}. {fix}")
    from ttt_zoo.fileio import atomic_path
    with atomic_path(path) as tmp:  # the temp is removed on failure
        try:
            torch.hub.download_url_to_file(pc.url, tmp, progress=True)
        except Exception as e:  # noqa: BLE001 - network errors of every kind
            raise CheckpointError(f"Could not download the pretrained weights of {looked}{pc.url} "
                                  f"({type(e).__name__}: {e}). {fix}") from e


def resolve_pretrained(variant: str, kwargs: Dict[str, Any]) -> None:
    """Decide where ``pretrained=True`` weights come from; updates ``kwargs['pretrained_cfg_overlay']``.

    - a Hub repo (``hf_hub_id``) that is reachable (online) or cached (offline): timm loads it;
    - otherwise the authors' ``url``, downloaded once to ``<torch hub>/checkpoints/ttt_zoo/<model>.<tag>.pth``;
    - ``file`` (or that download): read here with :func:`load_checkpoint_file` and handed to timm as ``state_dict``,
      so the model file's ``checkpoint_filter_fn`` sees every layout and nothing is unpickled unsafely.
    """
    from urllib.parse import urlparse
    from timm.models._builder import resolve_pretrained_cfg
    overlay = dict(kwargs.get("pretrained_cfg_overlay") or {})
    pc = resolve_pretrained_cfg(variant, pretrained_cfg=kwargs.get("pretrained_cfg"), pretrained_cfg_overlay=overlay)
    if pc is None or pc.state_dict:
        return
    if pc.source in ("local-dir", "hf-hub"):  # a converted folder: timm reads it; check it first, clearly
        path = (os.path.join(pc.file, "model.safetensors") if pc.source == "local-dir"
                else _hub_weights_path(pc.hf_hub_id, pc.hf_hub_filename, kwargs.get("cache_dir")))
        if path and os.path.isfile(path):
            check_safetensors(path)  # header only
            from ttt_zoo import hub_format  # the folder's config.json keys and its weights' recorded sha256
            folder = os.path.dirname(path)
            if os.path.isfile(os.path.join(folder, hub_format.CONFIG_NAME)):
                hub_format.check_weights(folder, hub_format.read_config(folder))
        return
    if pc.source:
        return
    if pc.hf_hub_id and not pc.file and pc.url:
        if _hub_has_weights(pc.hf_hub_id, pc.hf_hub_filename, kwargs.get("cache_dir")):
            return
        _logger.info("%s is not on the Hugging Face Hub (or not cached offline); using %s", pc.hf_hub_id, pc.url)
        overlay["hf_hub_id"] = None
    elif pc.hf_hub_id and not pc.file:
        return  # timm loads the repo; its errors name it
    path = pc.file
    if not path and pc.url and not os.path.basename(urlparse(pc.url).path):
        path = os.path.join(torch.hub.get_dir(), "checkpoints", "ttt_zoo",
                            f"{pc.architecture}.{pc.tag or 'default'}.pth")
        if not os.path.exists(path):
            _download_official(pc, path)
    if path:
        overlay["file"] = path  # timm loads the state dict; the file names it in messages
        overlay["state_dict"] = load_checkpoint_file(path)
        n, cls = kwargs.get("num_classes"), pc.classifier if isinstance(pc.classifier, str) else None
        if n is not None and n != pc.num_classes and cls:  # a fine-tune with the requested classes: keep its head
            w = unwrap_checkpoint(overlay["state_dict"]).get(f"{cls}.weight")
            if w is not None and w.dim() == 2 and w.shape[0] == n:
                overlay["num_classes"] = n
    kwargs["pretrained_cfg_overlay"] = overlay
