"""Hub folders: ``model.safetensors`` (no pickles), timm's ``config.json`` and a ``README.md`` model card.

Reading, building (with the ``checkpoint_filter_fn`` beside each model), validating, loading (``PATH``,
``local-dir:PATH``, ``hf-hub:ORG/NAME``), installing into a Hugging Face cache and pushing.  Non-timm
architectures (the dense-prediction backbones) are registered with :func:`register_hub_architecture`.
"""
from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ttt_zoo.checkpoint import (HUB_ORG, CheckpointError, check_safetensors, hub_unavailable_error,
                                load_checkpoint_file, unwrap_checkpoint)
from ttt_zoo.fileio import atomic_path, atomic_write, sha256_file
from ttt_zoo.errors import HubFolderError  # noqa: F401  (re-exported)

from .cards import REQUIRED_CARD_KEYS, arxiv_ids, parse_card

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"
#: timm reads these from config.json; pretrained_cfg needs the preprocessing fields
REQUIRED_CONFIG_FIELDS = ("architecture", "num_classes", "pretrained_cfg")
REQUIRED_PRETRAINED_FIELDS = ("input_size", "mean", "std", "interpolation", "crop_pct")
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".pkl", ".pickle", ".ckpt", ".tar")
#: the GitHub repo torch.hub loads ``hubconf.py`` from (set when the project has its public home)
GITHUB_REPO = "ttt-zoo/ttt-zoo"


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
    from ttt_zoo.models.hvit3 import HVIT3_SIZES, HViT3Backbone, backbone_filter_fn
    for size, cfg in HVIT3_SIZES.items():  # heads follow the widths (head dim 32), so a width override stays valid
        args = dict(embed_dim=cfg["embed_dim"], depths=cfg["depths"])
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


#: constructor arguments that timm's loaders derive themselves (``num_classes`` and ``global_pool`` from the config,
#: ``in_chans`` from ``pretrained_cfg.input_size``; timm ``_builder._update_default_model_kwargs``) and that other
#: clients pass explicitly: config.json's ``model_args`` never repeats them
LOADER_ARGS = ("num_classes", "global_pool", "in_chans")
_TAG_CHARS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


def registered_cfg(name: str) -> Optional[Dict[str, Any]]:
    """timm's pretrained cfg of ``model.tag`` (or of the model's default tag), or None for a tag it does not know
    (a user's own tag, e.g. 'vit3_tiny.digits')."""
    from timm.models import get_pretrained_cfg
    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError:  # 'Invalid pretrained tag'
        return None
    return cfg.to_dict() if cfg is not None else None


def check_tag(tag: str) -> str:
    """A tag usable in a hub id (``ORG/model.tag``): letters, digits, '_' and '-'."""
    if not _TAG_CHARS.match(tag):
        raise HubFolderError(f"Invalid tag {tag!r}: use letters, digits, '_' and '-' (e.g. 'digits', 'ft_cifar10').")
    return tag


def _checkpoint_weight(name: str, checkpoint: Dict[str, Any], cfg_key: str, dim: int) -> Optional[torch.Tensor]:
    """The checkpoint's weight of the module the pretrained cfg names under ``cfg_key`` ('classifier',
    'first_conv'), if it has ``dim`` dimensions."""
    module = (registered_cfg(name) or registered_cfg(_split(name)[0]) or {}).get(cfg_key)
    try:
        w = unwrap_checkpoint(checkpoint).get(f"{module}.weight") if isinstance(module, str) else None
    except CheckpointError:
        return None
    return w if w is not None and w.dim() == dim else None


def _checkpoint_classes(name: str, checkpoint: Dict[str, Any]) -> Optional[int]:
    """Rows of the checkpoint's classifier (named by the pretrained cfg), e.g. 10 for a 10-class fine-tune."""
    w = _checkpoint_weight(name, checkpoint, "classifier", 2)
    return int(w.shape[0]) if w is not None else None


def build_from_checkpoint(name: str, checkpoint: Any, model_args: Optional[Dict[str, Any]] = None,
                          source: str = "checkpoint") -> Tuple[nn.Module, Dict[str, Any]]:
    """Build ``name`` (``model`` or ``model.tag``) and load ``checkpoint`` (a path or a loaded dict) strictly.

    timm models load through timm's own path (``create_model(pretrained=True)`` with the checkpoint as the
    pretrained cfg's ``state_dict``: ``build_model_with_cfg`` -> ``load_pretrained`` -> the model file's
    ``checkpoint_filter_fn``); the classifier is built with the checkpoint's number of classes unless
    ``model_args`` sets ``num_classes``.  A tag timm does not know (a user's own, e.g. 'vit3_tiny.digits') builds
    the model's default cfg renamed to that tag, without the authors' weight locations.  Returns (model in eval
    mode, the constructor arguments used)."""
    import timm
    if isinstance(checkpoint, str):
        source, checkpoint = checkpoint, load_checkpoint_file(checkpoint)
    model_args = dict(model_args or {})
    arch, tag = _split(name)
    if tag:
        check_tag(tag)
    if arch not in _HUB_ARCHS and arch not in _zoo_models():
        known = ", ".join(_zoo_models() + sorted(_HUB_ARCHS))
        raise CheckpointError(f"Unknown model {arch!r}. ttt-zoo models: {known}.")
    try:
        if arch in _HUB_ARCHS:  # not a timm model: build, filter, load strictly
            spec = _HUB_ARCHS[arch]
            model = spec.build(**dict(spec.default_args, **model_args))
            model.load_state_dict(spec.filter_fn(checkpoint, model))
        else:
            n = _checkpoint_classes(name, checkpoint)
            if n is not None:
                model_args.setdefault("num_classes", n)
            overlay = dict(state_dict=checkpoint, **({"num_classes": n} if n is not None else {}))
            conv = _checkpoint_weight(name, checkpoint, "first_conv", 4)
            if conv is not None and model_args.get("in_chans") == conv.shape[1]:  # e.g. a 1-channel fine-tune
                size = (registered_cfg(name) or registered_cfg(arch) or {}).get("input_size") or (3, 224, 224)
                overlay["input_size"] = (conv.shape[1], *size[1:])  # its weights as they are, not adapted by timm
            variant = name
            if tag and registered_cfg(name) is None:  # a custom tag: not the authors' release
                overlay.update(tag=tag, url=None, hf_hub_id=None, hf_hub_filename=None, file=None)
                variant = arch
            model = timm.create_model(variant, pretrained=True, pretrained_cfg_overlay=overlay, **model_args)
    except TypeError as e:
        raise CheckpointError(f"Bad --model-args for {arch}: {e}") from e
    except CheckpointError as e:
        why = str(e).split(" Build the model that matches")[0]
        raise CheckpointError(f"{source} is not a checkpoint for {name}: {why} Pass the --model (see `ttt-zoo list`) "
                              f"and --model-kwargs K=V (or --model-args JSON) that match the checkpoint.") from e
    except RuntimeError as e:  # load_state_dict(strict=True)
        raise CheckpointError(f"{source} does not fit {name} (built with {model_args}): "
                              f"{str(e).splitlines()[-1].strip()}") from e
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


def rebuild_args(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Constructor arguments of a config.json's model: ``model_args`` plus the :data:`LOADER_ARGS` that timm's
    loaders take from ``num_classes`` and ``pretrained_cfg`` (what ``timm.create_model('local-dir:...')`` passes)."""
    args = dict(cfg.get("model_args") or {})
    if cfg["architecture"] in _HUB_ARCHS:
        return args
    pc = cfg["pretrained_cfg"]
    loader = dict(num_classes=cfg["num_classes"], in_chans=pc["input_size"][0])
    if pc.get("global_pool") is not None:
        loader["global_pool"] = pc["global_pool"]
    return dict(loader, **args)


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
    sha = sha256_file(source)
    if prov.get("source_sha256") and prov["source_sha256"] != sha:
        raise HubFolderError(f"{source} (sha256 {sha[:16]}...) is not the checkpoint {folder} was converted from "
                             f"({prov.get('source_file')}, sha256 {prov['source_sha256'][:16]}...).")
    name = cfg["architecture"] + (f".{cfg['pretrained_cfg']['tag']}" if cfg["pretrained_cfg"].get("tag") else "")
    ref, _ = build_from_checkpoint(name, source, rebuild_args(cfg))
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
        blob = os.path.join(repo_dir, "blobs", sha256_file(src))
        with atomic_path(blob, temp=blob + ".incomplete") as tmp:  # huggingface_hub's own partial-file suffix
            shutil.copyfile(src, tmp)
        dst = os.path.join(snap, name)
        if os.path.lexists(dst):
            os.remove(dst)
        os.symlink(os.path.relpath(blob, snap), dst)
    atomic_write(os.path.join(repo_dir, "refs", "main"), revision)
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
            log(f"  {f}  {os.path.getsize(p):,} bytes  sha256 {sha256_file(p)}")
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

