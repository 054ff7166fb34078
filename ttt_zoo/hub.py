"""Hugging Face Hub support: convert checkpoints into timm-format hub folders, validate them, push them.

A hub folder holds ``model.safetensors`` (no pickles), timm's ``config.json`` (architecture, num_classes,
model_args, pretrained_cfg, label names) and a ``README.md`` model card.  Everything is driven by timm's registry:
any ttt-zoo model registered with a pretrained tag can be converted, with the ``checkpoint_filter_fn`` that sits
beside it in its model file.  Non-timm architectures (the dense-prediction backbones) are registered here with
:func:`register_hub_architecture`.

Command line (also ``ttt-zoo convert`` / ``ttt-zoo push``)::

    python -m ttt_zoo.hub convert CKPT --model vit3_tiny.in1k --out hub/vit3_tiny.in1k
    python -m ttt_zoo.hub convert --all --checkpoint-dir ckpts --out hub
    python -m ttt_zoo.hub push hub/vit3_tiny.in1k --source CKPT --dry-run

Hub naming scheme: ``ttt-zoo/<model>.<tag>`` (see ``ttt_zoo.models._common.HUB_ORG``).
"""
from __future__ import annotations

import argparse
import copy
import fnmatch
import hashlib
import inspect
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ttt_zoo.cards import paper_results, parse_card, render_card, REQUIRED_CARD_KEYS
from ttt_zoo.checkpoint import (HUB_ORG, CheckpointError, check_safetensors, hub_unavailable_error, load_checkpoint_file,
                                unwrap_checkpoint)

__all__ = [
    "HUB_ORG", "WEIGHTS_NAME", "CONFIG_NAME", "CARD_NAME", "HubFolderError", "hub_repo_id", "registered_pretrained",
    "register_hub_architecture", "read_config", "build_from_checkpoint",
    "measure", "convert_checkpoint", "convert_all", "load_folder", "validate_folder", "push_folder",
    "install_to_hub_cache", "add_convert_parser", "add_push_parser", "main_convert", "main_push", "main",
]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"
#: timm reads these from config.json; pretrained_cfg needs the preprocessing fields
REQUIRED_CONFIG_FIELDS = ("architecture", "num_classes", "pretrained_cfg")
REQUIRED_PRETRAINED_FIELDS = ("input_size", "mean", "std", "interpolation", "crop_pct")
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".pkl", ".pickle", ".ckpt", ".tar")
#: the GitHub repo torch.hub loads ``hubconf.py`` from (set when the project has its public home)
GITHUB_REPO = "ttt-zoo/ttt-zoo"


class HubFolderError(ValueError):
    """A hub folder that is incomplete or inconsistent."""


def hub_repo_id(name: str, org: str = HUB_ORG) -> str:
    """'vit3_tiny.in1k' -> 'ttt-zoo/vit3_tiny.in1k' (timm's own scheme, with our organisation)."""
    return f"{org}/{name}"


def _zoo_models() -> List[str]:
    import timm
    from ttt_zoo.models import MODEL_MODULES
    return sorted({n for m in MODEL_MODULES for n in timm.list_models(module=m)})


def registered_pretrained() -> List[str]:
    """Every ``model.tag`` of ttt-zoo's timm registry that has released weights (a url or a hub id)."""
    import timm
    from ttt_zoo.models import MODEL_MODULES
    return sorted({n for m in MODEL_MODULES for n in timm.list_models(module=m, pretrained=True)})


# ----- architectures that are not timm models -----

@dataclass
class HubArchitecture:
    """A non-timm architecture a hub folder can hold (e.g. an mmdet/mmseg backbone)."""
    name: str
    build: Callable[..., nn.Module]
    filter_fn: Callable[[Dict[str, Any], nn.Module], Dict[str, torch.Tensor]]
    default_args: Dict[str, Any] = field(default_factory=dict)
    kind: str = "backbone"
    description: str = ""
    pretrained_cfg: Dict[str, Any] = field(default_factory=dict)


_HUB_ARCHS: Dict[str, HubArchitecture] = {}


def register_hub_architecture(arch: HubArchitecture) -> HubArchitecture:
    _HUB_ARCHS[arch.name] = arch
    return arch


def _register_backbones() -> None:
    from ttt_zoo.models.hvit3 import HViT3Backbone, backbone_filter_fn
    sizes = {"tiny": dict(embed_dim=(64, 128, 320, 512), depths=(1, 3, 9, 4)),
             "small": dict(embed_dim=(64, 128, 320, 512), depths=(2, 6, 18, 8)),
             "base": dict(embed_dim=(96, 192, 448, 640), depths=(2, 6, 18, 8))}
    for size, args in sizes.items():
        register_hub_architecture(HubArchitecture(
            name=f"hvit3_backbone_{size}", build=HViT3Backbone, filter_fn=backbone_filter_fn, default_args=args,
            description=("H-ViT3 dense-prediction backbone (the authors' mmdet/mmseg `ViTTT` layout): four stages of "
                         "ViT3 TTT blocks, LayerNorm'ed outputs at strides 4/8/16/32, any input size."),
            pretrained_cfg=dict(license="apache-2.0", paper_ids="arXiv:2512.01643",
                                paper_name="ViT3: Unlocking Test-Time Training in Vision",
                                origin_url="https://github.com/LeapLabTHU/ViTTT",
                                input_size=(3, 224, 224), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                                interpolation="bicubic", crop_pct=1.0)))


_register_backbones()


# ----- reading files, with clear errors -----

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_config(folder: str) -> Dict[str, Any]:
    """Read ``config.json``; missing or malformed fields get a clear :class:`HubFolderError`."""
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(path):
        raise HubFolderError(f"{folder} has no {CONFIG_NAME}. Create the folder with `ttt-zoo convert`.")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise HubFolderError(f"{path} is not valid JSON ({e}). Re-run `ttt-zoo convert`.") from e
    if not isinstance(cfg, dict):
        raise HubFolderError(f"{path} must hold a JSON object, got {type(cfg).__name__}.")
    missing = [k for k in REQUIRED_CONFIG_FIELDS if k not in cfg]
    pc = cfg.get("pretrained_cfg")
    if isinstance(pc, dict):
        missing += [f"pretrained_cfg.{k}" for k in REQUIRED_PRETRAINED_FIELDS if k not in pc]
    elif "pretrained_cfg" in cfg:
        raise HubFolderError(f"{path}: 'pretrained_cfg' must be a JSON object, got {type(pc).__name__}.")
    if missing:
        raise HubFolderError(
            f"{path} is missing required field(s) {', '.join(repr(m) for m in missing)}; timm needs them to "
            f"build the model and its preprocessing. Re-run `ttt-zoo convert` to write a complete config.json.")
    arch = cfg["architecture"]
    if arch not in _HUB_ARCHS and arch not in _zoo_models():
        raise HubFolderError(f"{path}: architecture {arch!r} is not a ttt-zoo model (see `ttt-zoo list`).")
    return cfg


# ----- building a model from a checkpoint -----

def _split(name: str) -> Tuple[str, str]:
    arch, _, tag = name.partition(".")
    return arch, tag


def _filter_fn_for(arch: str) -> Optional[Callable]:
    """The ``checkpoint_filter_fn`` beside the model in its file (timm's convention)."""
    if arch in _HUB_ARCHS:
        return _HUB_ARCHS[arch].filter_fn
    import timm
    module = sys.modules[timm.models.model_entrypoint(arch).__module__]
    return getattr(module, "checkpoint_filter_fn", None)


def _create(name: str, model_args: Dict[str, Any]) -> nn.Module:
    arch, tag = _split(name)
    if arch in _HUB_ARCHS:
        spec = _HUB_ARCHS[arch]
        return spec.build(**dict(spec.default_args, **model_args))
    if arch not in _zoo_models():
        known = ", ".join(_zoo_models() + sorted(_HUB_ARCHS))
        raise CheckpointError(f"Unknown model {arch!r}. ttt-zoo models: {known}.")
    import timm
    try:
        return timm.create_model(name, pretrained=False, **model_args)
    except TypeError as e:
        raise CheckpointError(f"Bad --model-args for {arch}: {e}") from e


def _classifier_fix(model: nn.Module, sd: Dict[str, torch.Tensor]) -> Optional[int]:
    """num_classes of the checkpoint's classifier when it differs from the model's (e.g. a 10-class fine-tune)."""
    cls = (getattr(model, "pretrained_cfg", None) or {}).get("classifier")
    if not cls:
        return None
    theirs, own = sd.get(f"{cls}.weight"), model.state_dict().get(f"{cls}.weight")
    if (theirs is not None and own is not None and theirs.dim() == own.dim() == 2
            and theirs.shape[1] == own.shape[1] and theirs.shape[0] != own.shape[0]):
        return int(theirs.shape[0])
    return None


def build_from_checkpoint(name: str, checkpoint: Any, model_args: Optional[Dict[str, Any]] = None,
                          source: str = "checkpoint") -> Tuple[nn.Module, Dict[str, Any]]:
    """Build ``name`` (``model`` or ``model.tag``) and load ``checkpoint`` (a path or a loaded dict) strictly.

    Returns (model in eval mode, the constructor arguments used)."""
    if isinstance(checkpoint, str):
        source = checkpoint
        checkpoint = load_checkpoint_file(checkpoint)
    model_args = dict(model_args or {})
    model = _create(name, model_args)
    if "num_classes" not in model_args:
        try:
            n = _classifier_fix(model, unwrap_checkpoint(checkpoint))
        except CheckpointError:
            n = None
        if n is not None:  # build the classifier the checkpoint has
            model_args["num_classes"] = n
            model = _create(name, model_args)
    arch = _split(name)[0]
    filter_fn = _filter_fn_for(arch)
    try:
        sd = filter_fn(checkpoint, model) if filter_fn is not None else unwrap_checkpoint(checkpoint)
    except CheckpointError as e:
        why = str(e).split(" Build the model that matches")[0]
        raise CheckpointError(f"{source} is not a checkpoint for {name}: {why} Pass the --model (see `ttt-zoo list`) "
                              f"and --model-args that match the checkpoint.") from e
    try:
        result = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{source} does not fit {name} (built with {model_args}): "
                              f"{str(e).splitlines()[-1].strip()}") from e
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{source} does not fit {name}: missing keys {result.missing_keys[:5]}, unexpected keys "
            f"{result.unexpected_keys[:5]}. Pass the right --model or --model-args.")
    return model.eval(), model_args


# ----- inputs, measurements -----

def example_inputs(model: nn.Module, batch: int = 1, device: Any = "cpu", seed: int = 0,
                   input_size: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, ...]:
    """Inputs for ``model``: its own ``example_inputs(batch)`` if it has one, else an image batch of the
    pretrained cfg's size, plus DiT-style ``t`` (timesteps) and ``y`` (labels) when ``forward`` takes them."""
    if hasattr(model, "example_inputs"):
        return tuple(model.example_inputs(batch))
    g = torch.Generator().manual_seed(seed)
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    c, h, w = input_size or cfg.get("input_size", (getattr(model, "in_chans", 3), 224, 224))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    x = torch.randn(batch, c, h, w, generator=g).to(device=device, dtype=dtype)
    params = list(inspect.signature(model.forward).parameters)
    if params[:3] == ["x", "t", "y"]:
        t = torch.randint(0, 1000, (batch,), generator=g).to(device)
        y = torch.randint(0, max(int(getattr(model, "num_classes", 1000)), 1), (batch,), generator=g).to(device)
        return x, t, y
    return (x,)


def _flat_outputs(out: Any) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat_outputs(o)]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flat_outputs(out[k])]
    return []


def measure(model: nn.Module, input_size: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Parameters and GMACs (``torch.utils.flop_counter`` FLOPs / 2) for one sample, counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode
    params = sum(p.numel() for p in model.parameters())
    meta = copy.deepcopy(model).to("meta").eval()
    inputs = tuple(t.to("meta") for t in example_inputs(model, 1, input_size=input_size))
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.no_grad():
            meta(*inputs)
        macs = counter.get_total_flops() / 2e9
    except Exception:  # noqa: BLE001 - a model that cannot run on meta simply gets no GMACs on its card
        macs = None
    return dict(params=params, macs=macs, macs_input=list(inputs[0].shape[1:]))


# ----- conversion -----

def _kind(arch: str, model: nn.Module) -> str:
    """'backbone' (non-timm architectures), 'diffusion' (forward(x, t, y)) or 'classifier'."""
    if arch in _HUB_ARCHS:
        return _HUB_ARCHS[arch].kind
    if list(inspect.signature(model.forward).parameters)[:3] == ["x", "t", "y"]:
        return "diffusion"
    return "classifier"


def _description(arch: str) -> str:
    if arch in _HUB_ARCHS:
        return _HUB_ARCHS[arch].description
    import timm
    module = sys.modules[timm.models.model_entrypoint(arch).__module__]
    doc = (module.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split())


def _label_info(num_classes: int, name: str) -> Dict[str, Any]:
    """ImageNet-1k synsets and descriptions for 1000-class ImageNet checkpoints; nothing otherwise."""
    tag = _split(name)[1]
    if num_classes != 1000 or ("in1k" not in tag and "in22k_ft_in1k" not in tag and "imagenet" not in tag):
        return {}
    from timm.data import ImageNetInfo
    info = ImageNetInfo()
    names = list(info.label_names())
    return dict(label_names=names, label_descriptions={n: info.label_name_to_description(n) for n in names})


def _datasets(name: str, kind: str) -> List[str]:
    tag = _split(name)[1]
    if kind == "backbone":
        return ["detection-datasets/coco"] if "coco" in tag else ["scene_parse_150"] if "ade" in tag else []
    if "in1k" in tag or "imagenet" in tag:
        return ["imagenet-1k"]
    return []


#: constructor arguments that keep the released architecture (anything else makes a different network)
_SAME_ARCH_ARGS = ("num_classes", "in_chans", "img_size", "global_pool")


def _partial_dir(out_dir: str, overwrite: bool) -> str:
    """Check ``out_dir`` before any work and create the temporary folder beside it that the new files go into."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise HubFolderError(f"The output path {out_dir} is a file; give a folder path (it is created if needed).")
    if os.path.isdir(out_dir):
        if os.listdir(out_dir) and not overwrite:
            raise HubFolderError(f"{out_dir} exists and is not empty; pass --force to replace it.")
        if not os.access(out_dir, os.W_OK):
            raise HubFolderError(f"{out_dir} is read-only; make it writable or choose another output folder.")
    parent, base = os.path.split(out_dir)
    prefix = f".{base}.partial-"
    for stale in os.listdir(parent) if os.path.isdir(parent) else []:  # left by a killed convert
        pid = stale[len(prefix):].split("-")[0]
        if stale.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
    except OSError as e:
        raise HubFolderError(f"Cannot write the output folder {out_dir}: {e.strerror} ({parent}). Choose an "
                             f"output folder you can write to.") from e
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0  # AT_FDCWD, RENAME_EXCHANGE


def _swap_in(tmp: str, out_dir: str) -> None:
    """Replace ``out_dir`` by the complete folder ``tmp``: a kill at any point leaves a complete folder (old or new).

    Files of the old folder that conversion does not write (e.g. a .gitattributes) are kept."""
    out_dir = os.path.abspath(out_dir)
    if not os.path.isdir(out_dir):
        os.rename(tmp, out_dir)
        return
    for f in os.listdir(out_dir):
        if not os.path.exists(os.path.join(tmp, f)):
            src = os.path.join(out_dir, f)
            (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(tmp, f))
    if _exchange(tmp, out_dir):
        shutil.rmtree(tmp)  # tmp now holds the old folder
        return
    old = tmp + ".old"  # two renames: in between, out_dir is briefly absent but both folders are complete
    os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old)


def convert_checkpoint(checkpoint: str, name: str, out_dir: str, model_args: Optional[Dict[str, Any]] = None,
                       hub_id: Optional[str] = None, flops: bool = True, overwrite: bool = False,
                       source_url: Optional[str] = None) -> Dict[str, Any]:
    """Convert one checkpoint into a hub folder; returns the info the card was rendered from.

    The files are written into a temporary folder beside ``out_dir`` that replaces it only once complete, so an
    existing folder is never lost.  ``source_url``: where ``checkpoint`` was downloaded from, if known (the card
    only claims a release it knows)."""
    tmp = _partial_dir(out_dir, overwrite)
    try:
        info = _write_folder(checkpoint, name, tmp, model_args, hub_id, flops, source_url)
        _swap_in(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return info


def _write_folder(checkpoint: str, name: str, out_dir: str, model_args: Optional[Dict[str, Any]],
                  hub_id: Optional[str], flops: bool, source_url: Optional[str]) -> Dict[str, Any]:
    """Write model.safetensors, config.json and README.md for ``checkpoint`` into the empty folder ``out_dir``."""
    from safetensors.torch import save_file
    from timm.models._hub import save_config_for_hf
    from ttt_zoo import __version__

    model, used_args = build_from_checkpoint(name, checkpoint, model_args)
    if "." not in name and (getattr(model, "pretrained_cfg", None) or {}).get("tag"):
        name = f"{name}.{model.pretrained_cfg['tag']}"  # 'vit3_tiny' -> its default tag 'vit3_tiny.in1k'
    arch, tag = _split(name)
    hub_id = hub_id or hub_repo_id(name)
    kind = _kind(arch, model)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}

    if arch in _HUB_ARCHS:
        pc = dict(_HUB_ARCHS[arch].pretrained_cfg, architecture=arch, tag=tag or None)
        num_classes = 0
    else:
        pc = dict(model.pretrained_cfg)
        num_classes = getattr(model, "num_classes", 0)
    input_size = tuple(pc.get("input_size", (3, 224, 224)))
    if "img_size" in used_args:
        s = used_args["img_size"]
        input_size = (input_size[0],) + ((s, s) if isinstance(s, int) else tuple(s))
    if "in_chans" in used_args:
        input_size = (used_args["in_chans"],) + input_size[1:]
    numbers = measure(model, input_size if kind != "diffusion" else None) if flops else dict(
        params=sum(p.numel() for p in model.parameters()), macs=None, macs_input=list(input_size))

    save_file(sd, os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    os.chmod(os.path.join(out_dir, WEIGHTS_NAME), 0o644)

    provenance = dict(version=__version__, hub_id=hub_id, kind=kind, source_file=os.path.basename(checkpoint),
                      source_sha256=_sha256(checkpoint), params=numbers["params"], gmacs=numbers["macs"],
                      gmacs_input=numbers["macs_input"], source_url=source_url)
    labels = _label_info(num_classes, name)
    if arch in _HUB_ARCHS:
        config = dict(architecture=arch, num_classes=0, model_args=_jsonable(used_args),
                      pretrained_cfg=_jsonable({k: v for k, v in pc.items() if v is not None}), ttt_zoo=provenance)
        with open(os.path.join(out_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    else:
        data_cfg = {"input_size": input_size} if input_size != tuple(pc.get("input_size", ())) else None
        added = [a for a in ("num_features",) if not hasattr(model, a)]  # timm reads it; DiT-style models lack it
        for a in added:
            setattr(model, a, None)
        try:
            save_config_for_hf(model, os.path.join(out_dir, CONFIG_NAME),
                               model_config=dict(labels, ttt_zoo=provenance), data_config=data_cfg)
        finally:
            for a in added:
                delattr(model, a)
    custom_args = {k: v for k, v in used_args.items() if k != "num_classes" or v != 1000}
    other_arch = sorted(k for k in custom_args if k not in _SAME_ARCH_ARGS)

    info = dict(name=name, architecture=arch, hub_id=hub_id, library="ttt-zoo" if arch in _HUB_ARCHS else "timm",
                kind=kind, license=pc.get("license"), datasets=[] if other_arch else _datasets(name, kind),
                paper_ids=pc.get("paper_ids"), released_url=pc.get("url"), other_arch=other_arch,
                paper_name=pc.get("paper_name"), origin_url=pc.get("origin_url"), description=_description(arch),
                input_size=input_size, mean=pc.get("mean"), std=pc.get("std"), crop_pct=pc.get("crop_pct"),
                interpolation=pc.get("interpolation"), num_classes=num_classes, params=numbers["params"],
                macs=numbers["macs"], macs_input=numbers["macs_input"], source_file=os.path.basename(checkpoint),
                source_sha256=provenance["source_sha256"], source_url=source_url, model_args=custom_args,
                paper=None if other_arch else paper_results(name), github=GITHUB_REPO)
    with open(os.path.join(out_dir, CARD_NAME), "w", encoding="utf-8") as f:
        f.write(render_card(info))
    return info


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=list))


def _find_source(name: str, checkpoint_dir: str) -> Optional[str]:
    for ext in (".pth", ".pth.tar", ".pt", ".safetensors", ".bin"):
        p = os.path.join(checkpoint_dir, name + ext)
        if os.path.isfile(p):
            return p
    return None


def default_checkpoint_dir() -> str:
    """Where ``pretrained=True`` caches the authors' checkpoints (``<torch hub>/checkpoints/ttt_zoo``)."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", "ttt_zoo")


def convert_all(out_root: str, checkpoint_dir: Optional[str] = None, pattern: str = "*", download: bool = False,
                skip_missing: bool = False, flops: bool = True, overwrite: bool = False,
                log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Convert every registered pretrained tag matching ``pattern``; sources are ``<dir>/<model>.<tag>.pth``."""
    from timm.models import get_pretrained_cfg
    checkpoint_dir = checkpoint_dir or default_checkpoint_dir()
    names = [n for n in registered_pretrained() if fnmatch.fnmatch(n, pattern)]
    if not names:
        raise HubFolderError(f"No registered pretrained tag matches {pattern!r}; see `ttt-zoo list`.")
    missing = []
    for n in names:
        if _find_source(n, checkpoint_dir) is None:
            url = get_pretrained_cfg(n).url
            if download and url:
                os.makedirs(checkpoint_dir, exist_ok=True)
                tmp = os.path.join(checkpoint_dir, n + ".pth.partial")
                torch.hub.download_url_to_file(url, tmp, progress=True)
                os.replace(tmp, os.path.join(checkpoint_dir, n + ".pth"))
            else:
                missing.append(n)
    if missing and not skip_missing:
        raise HubFolderError(
            f"No source checkpoint in {checkpoint_dir} for {', '.join(missing)} (expected <model>.<tag>.pth). "
            f"Pass --download to fetch the authors' files, or --skip-missing.")
    done = {}
    for n in names:
        if n in missing:
            log(f"skip {n}: no checkpoint in {checkpoint_dir}")
            continue
        src = _find_source(n, checkpoint_dir)
        out = os.path.join(out_root, n)
        # files in the pretrained=True cache (or fetched by --download) came from the cfg's url
        url = get_pretrained_cfg(n).url if (download or checkpoint_dir == default_checkpoint_dir()) else None
        info = convert_checkpoint(src, n, out, flops=flops, overwrite=overwrite, source_url=url)
        done[n] = out
        log(f"converted {src} -> {out} ({info['params']:,} params)")
    return dict(converted=done, missing=missing)


# ----- loading and validating folders -----

def _resolve_folder(path_or_id: str, cache_dir: Optional[str] = None) -> str:
    if path_or_id.startswith("hf-hub:"):
        from huggingface_hub import snapshot_download
        repo, _, rev = path_or_id[len("hf-hub:"):].partition("@")
        try:
            return snapshot_download(repo, revision=rev or None, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - offline / not found / network: one clear message
            raise hub_unavailable_error(repo, "the model folder", e) from e
    if path_or_id.startswith("local-dir:"):
        path_or_id = path_or_id[len("local-dir:"):]
    return path_or_id


def load_folder(path_or_id: str, cache_dir: Optional[str] = None, **kwargs) -> nn.Module:
    """Build the model of a hub folder (``PATH``, ``local-dir:PATH`` or ``hf-hub:ORG/NAME``) with its weights.

    timm models go through ``timm.create_model('local-dir:...', pretrained=True)``; non-timm architectures are
    built from ``model_args`` and loaded strictly.  Folder problems raise clear errors first."""
    folder = _resolve_folder(path_or_id, cache_dir)
    cfg = read_config(folder)
    weights = os.path.join(folder, WEIGHTS_NAME)
    arch = cfg["architecture"]
    if arch in _HUB_ARCHS:
        model, _ = build_from_checkpoint(arch, weights, dict(cfg.get("model_args") or {}, **kwargs))
        return model
    if not os.path.isfile(weights):
        raise CheckpointError(f"Weights file {weights} does not exist. Run `ttt-zoo convert` to create it.")
    check_safetensors(weights)  # header only: timm reads the file once, through ttt_zoo.checkpoint
    import timm
    return timm.create_model(f"local-dir:{folder}", pretrained=True, **kwargs).eval()


def _check_card(folder: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    path = os.path.join(folder, CARD_NAME)
    if not os.path.isfile(path):
        raise HubFolderError(f"{folder} has no {CARD_NAME} model card. Re-run `ttt-zoo convert`.")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        meta, body = parse_card(text)
    except ValueError as e:
        raise HubFolderError(f"{path}: {e}") from e
    missing = [k for k in REQUIRED_CARD_KEYS if not meta.get(k)]
    if missing:
        raise HubFolderError(f"{path}: front matter lacks {', '.join(missing)}.")
    want_lib = "ttt-zoo" if cfg["architecture"] in _HUB_ARCHS else "timm"
    if meta["library_name"] != want_lib:
        raise HubFolderError(f"{path}: library_name is {meta['library_name']!r}, expected {want_lib!r}.")
    from ttt_zoo.cards import arxiv_ids
    for i in arxiv_ids(cfg["pretrained_cfg"].get("paper_ids")):
        if f"arxiv:{i}" not in meta["tags"]:
            raise HubFolderError(f"{path}: tags lack 'arxiv:{i}' (the paper in config.json).")
    if "measured by ttt-zoo" not in body:
        raise HubFolderError(f"{path}: the card does not say which numbers ttt-zoo measured.")
    return meta


def validate_folder(folder: str, source: Optional[str] = None, rtol: float = 1e-5, atol: float = 1e-5,
                    check_source: bool = True) -> Dict[str, Any]:
    """Check a hub folder before upload: files (no pickles), config.json, card metadata, that the weights load
    through timm's ``local-dir:`` path, and that outputs match the ``source`` checkpoint."""
    if not os.path.isdir(folder):
        raise HubFolderError(f"{folder} is not a folder.")
    files = sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise HubFolderError(f"{folder} holds pickle files {pickles}; hub folders carry only {WEIGHTS_NAME}. "
                             f"Remove them.")
    cfg = read_config(folder)
    n_tensors = check_safetensors(os.path.join(folder, WEIGHTS_NAME))
    card = _check_card(folder, cfg)
    model = load_folder(folder)
    report = dict(folder=folder, files=files, architecture=cfg["architecture"], card=card,
                  tensors=n_tensors, source_checked=False)
    if not check_source:
        return report
    prov = cfg.get("ttt_zoo") or {}
    if source is None:
        raise HubFolderError("Pass --source CKPT (the checkpoint the folder was converted from) so the folder's "
                             "outputs can be compared with it, or --no-source-check to skip that comparison.")
    sha = _sha256(source)
    if prov.get("source_sha256") and prov["source_sha256"] != sha:
        raise HubFolderError(f"{source} (sha256 {sha[:16]}...) is not the checkpoint {folder} was converted from "
                             f"({prov.get('source_file')}, sha256 {prov['source_sha256'][:16]}...).")
    name = cfg["architecture"] + (f".{cfg['pretrained_cfg']['tag']}" if cfg["pretrained_cfg"].get("tag") else "")
    ref, _ = build_from_checkpoint(name, source, dict(cfg.get("model_args") or {}))
    inputs = example_inputs(model, batch=2, input_size=cfg["pretrained_cfg"]["input_size"]
                            if prov.get("kind", "classifier") != "diffusion" else None)
    with torch.no_grad():
        got, want = _flat_outputs(model(*inputs)), _flat_outputs(ref(*inputs))
    if len(got) != len(want):
        raise HubFolderError(f"{folder} gives {len(got)} outputs, the source checkpoint {len(want)}.")
    diff = 0.0
    for g, w in zip(got, want):
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise HubFolderError(f"Outputs of {folder} differ from those of {source}: {e}") from e
        diff = max(diff, (g - w).abs().max().item())
    report.update(source_checked=True, max_abs_diff=diff, source_sha256=sha)
    return report


def install_to_hub_cache(folder: str, repo_id: str, cache_dir: Optional[str] = None,
                         revision: str = "0" * 40) -> str:
    """Place a folder in a Hugging Face cache as ``repo_id`` (models--ORG--NAME/{blobs,snapshots/<rev>,refs/main}),
    so ``hf-hub:`` loading finds it offline.  Returns the snapshot folder."""
    if cache_dir is None:
        from huggingface_hub import constants
        cache_dir = constants.HF_HUB_CACHE
    repo_dir = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo_dir, "snapshots", revision)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(repo_dir, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    for name in os.listdir(folder):
        src = os.path.join(folder, name)
        if not os.path.isfile(src):
            continue
        blob = os.path.join(repo_dir, "blobs", _sha256(src))
        shutil.copyfile(src, blob)
        dst = os.path.join(snap, name)
        if os.path.lexists(dst):
            os.remove(dst)
        os.symlink(os.path.relpath(blob, snap), dst)
    with open(os.path.join(repo_dir, "refs", "main"), "w") as f:
        f.write(revision)
    return snap


def push_folder(folder: str, repo_id: Optional[str] = None, source: Optional[str] = None, dry_run: bool = False,
                check_source: bool = True, private: bool = False, revision: Optional[str] = None,
                commit_message: Optional[str] = None, token: Optional[str] = None,
                log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Validate ``folder`` and upload it with huggingface_hub's ``create_repo`` + ``upload_folder``."""
    report = validate_folder(folder, source=source, check_source=check_source)
    cfg = read_config(folder)
    repo_id = repo_id or (cfg.get("ttt_zoo") or {}).get("hub_id")
    if not repo_id or repo_id.count("/") != 1:
        raise HubFolderError(f"Give --repo-id ORG/NAME (got {repo_id!r}); ttt-zoo's scheme is {HUB_ORG}/<model>.<tag>.")
    log(f"validated {folder}: {report['tensors']} tensors, card ok, loads with timm"
        + (f", outputs match {source} (max abs diff {report['max_abs_diff']:.3g})" if report["source_checked"]
           else ", source comparison skipped"))
    if dry_run:
        log(f"dry run: would create {'private ' if private else ''}model repo {repo_id} and upload to "
            f"{revision or 'main'}:")
        for f in report["files"]:
            p = os.path.join(folder, f)
            log(f"  {f}  {os.path.getsize(p):,} bytes  sha256 {_sha256(p)}")
        report.update(repo_id=repo_id, uploaded=False)
        return report
    from huggingface_hub import HfApi
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                               commit_message=commit_message or f"Upload {repo_id} (ttt-zoo convert)")
    log(f"uploaded {folder} to https://huggingface.co/{repo_id}")
    report.update(repo_id=repo_id, uploaded=True, commit=str(commit))
    return report


# ----- command line -----

def _json_arg(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--model-args must be a JSON object, e.g. '{{\"depth\": 2}}' ({e})")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--model-args must be a JSON object, e.g. '{\"depth\": 2}'")
    return value


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("convert", help="convert checkpoints into timm-format Hugging Face Hub folders",
                              description="Convert an official or ttt-zoo checkpoint into a hub folder "
                                          "(model.safetensors, config.json, README.md).")
    p.add_argument("checkpoint", nargs="?", help="checkpoint file (.pth / .pt / .safetensors; any official layout)")
    p.add_argument("--model", help="ttt-zoo model, with its pretrained tag, e.g. vit3_tiny.in1k")
    p.add_argument("--out", help="output folder (default: ./hub/<model>)")
    p.add_argument("--model-args", type=_json_arg, default=None, help="JSON constructor arguments for "
                   "non-default architectures, e.g. '{\"embed_dim\": 64, \"depth\": 2}'")
    p.add_argument("--hub-id", help=f"repo id recorded in the folder (default {HUB_ORG}/<model>.<tag>)")
    p.add_argument("--source-url", help="where CHECKPOINT was downloaded from (stated on the card)")
    p.add_argument("--all", action="store_true", help="convert every registered pretrained tag")
    p.add_argument("--filter", default="*", help="with --all: only tags matching this glob")
    p.add_argument("--checkpoint-dir", help="with --all: folder of <model>.<tag>.pth files "
                   "(default: where pretrained=True caches the authors' files)")
    p.add_argument("--out-root", default="hub", help="with --all: parent of the output folders")
    p.add_argument("--download", action="store_true", help="with --all: download missing authors' checkpoints")
    p.add_argument("--skip-missing", action="store_true", help="with --all: skip tags without a checkpoint")
    p.add_argument("--no-flops", action="store_true", help="do not measure GMACs")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    p.set_defaults(func=_run_convert)
    return p


def add_push_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("push", help="validate a hub folder and upload it to the Hugging Face Hub",
                              description="Validate a converted folder (card, config, weights load, outputs match "
                                          "the source checkpoint), then create_repo + upload_folder.")
    p.add_argument("folder")
    p.add_argument("--repo-id", help=f"ORG/NAME (default: the id recorded at conversion, {HUB_ORG}/<model>.<tag>)")
    p.add_argument("--source", help="the checkpoint the folder was converted from (outputs are compared)")
    p.add_argument("--no-source-check", action="store_true", help="skip the comparison with the source")
    p.add_argument("--dry-run", action="store_true", help="validate and print what would be uploaded; no network")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", help="branch to upload to (default main)")
    p.add_argument("--commit-message")
    p.add_argument("--token", help="Hugging Face token (default: the logged-in one)")
    p.set_defaults(func=_run_push)
    return p


def _cli_errors(fn):
    """Print ttt-zoo's clear errors as one line and exit with status 2 instead of a traceback."""
    def run(args) -> int:
        try:
            return fn(args)
        except (CheckpointError, HubFolderError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run


@_cli_errors
def _run_convert(args) -> int:
    if args.all:
        res = convert_all(args.out_root, args.checkpoint_dir, args.filter, args.download, args.skip_missing,
                          not args.no_flops, args.force)
        print(f"converted {len(res['converted'])} checkpoint(s); missing: {res['missing'] or 'none'}")
        return 0
    if not args.checkpoint or not args.model:
        raise HubFolderError("Give a CHECKPOINT and --model MODEL.TAG (registered: "
                             f"{', '.join(registered_pretrained())}), or use --all.")
    out = args.out or os.path.join("hub", args.model)
    info = convert_checkpoint(args.checkpoint, args.model, out, args.model_args, args.hub_id,
                              not args.no_flops, args.force, args.source_url)
    macs = f", {info['macs']:.3f} GMACs" if info["macs"] is not None else ""
    print(f"converted {args.checkpoint} -> {out} ({info['params']:,} params{macs}); hub id {info['hub_id']}")
    return 0


@_cli_errors
def _run_push(args) -> int:
    push_folder(args.folder, args.repo_id, args.source, args.dry_run, not args.no_source_check, args.private,
                args.revision, args.commit_message, args.token)
    return 0


def _main(argv: Optional[Sequence[str]], add) -> int:
    parser = argparse.ArgumentParser(prog="ttt-zoo")
    sub = parser.add_subparsers(dest="command", required=True)
    for a in add:
        a(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def main_convert(argv: Optional[Sequence[str]] = None) -> int:
    """``ttt-zoo convert ...`` (argv without the subcommand)."""
    return _main(["convert", *(sys.argv[1:] if argv is None else argv)], [add_convert_parser])


def main_push(argv: Optional[Sequence[str]] = None) -> int:
    """``ttt-zoo push ...`` (argv without the subcommand)."""
    return _main(["push", *(sys.argv[1:] if argv is None else argv)], [add_push_parser])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ttt_zoo.hub {convert,push} ...``"""
    return _main(argv, [add_convert_parser, add_push_parser])


if __name__ == "__main__":
    sys.exit(main())
