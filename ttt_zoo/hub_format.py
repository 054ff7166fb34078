"""The Hub folder format: every ``config.json`` key ttt-zoo writes, its type and range, what it means and who reads
it; the one writer (:func:`write_config`) and the one reader (:func:`read_config`) of ``config.json``, and the check
of the weights' sha256 (:func:`check_weights`).

A folder holds ``model.safetensors``, ``config.json`` and a ``README.md`` card.  ``config.json`` is laid out as the
``timm/`` organisation's repositories (timm's ``save_config_for_hf``).  Readers, named in :data:`KEYS`:

- ``timm``: ``create_model('hf-hub:...' | 'local-dir:...')`` (``_hub._parse_model_cfg``: ``architecture``,
  ``num_classes``, ``label_names``, ``label_descriptions``, ``model_args``, ``pretrained_cfg``; other keys ignored);
- ``transformers``: ``TimmWrapperConfig`` (``architecture``, ``num_classes`` -> ``num_labels``, ``label_names`` ->
  ``id2label``, ``model_args``; other keys kept as plain attributes);
- ``ttt-zoo``: :mod:`ttt_zoo.hub` (loading, validating, pushing, ``predict``) and ``resolve_pretrained`` on timm's
  path.  The ``ttt_zoo`` block (provenance and the weights' sha256) is read by ttt-zoo only.

A malformed key is refused in one line naming the key (:class:`HubFolderError`).  Ground floor: imports only
``errors``, ``fileio``, ``flags`` and the standard library (timm lazily, for its interpolation names).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, Iterator, Optional, Tuple

from ttt_zoo.errors import HubFolderError
from ttt_zoo.fileio import atomic_write, sha256_file
from ttt_zoo.flags import CROP_PCT, MAX_IMG_SIDE, MEAN, NOT_MODEL_KWARGS, STD

__all__ = ["WEIGHTS_NAME", "CONFIG_NAME", "CARD_NAME", "LOADER_ARGS", "KINDS", "Key", "KEYS", "PRETRAINED_KEYS",
           "PROVENANCE_KEYS", "validate_config", "read_config", "write_config", "check_weights", "architecture",
           "model_name", "kind", "provenance", "num_classes", "hub_id", "source", "model_args", "loader_args", "input_size", "timm_config",
           "plain_config", "with_weights_sha256", "key_table", "HUB_ORG"]

#: Hub organisation of converted ttt-zoo weights; repos are named ``<model>.<tag>`` like timm's own.
HUB_ORG = "ttt-zoo"

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"
#: constructor arguments timm's loaders derive themselves (``num_classes`` and ``global_pool`` from the config,
#: ``in_chans`` from ``pretrained_cfg.input_size``) and other clients pass explicitly: ``model_args`` never has them
LOADER_ARGS = ("num_classes", "global_pool", "in_chans")
#: of those, the ones a folder never records in ``model_args`` (clients pass num_classes themselves, e.g. transformers'
#: TimmWrapper passes 0); a global_pool other than the model's default is recorded there (timm's PretrainedCfg has no
#: field for it, and timm's loaders ``setdefault`` every ``model_args`` key)
_DERIVED_ARGS = ("num_classes", "in_chans")
#: what a folder holds (``ttt_zoo.kind``): an image classifier, a diffusion transformer, a dense-prediction backbone
KINDS = ("classifier", "diffusion", "backbone")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_CROP_MODES = ("center", "squash", "border")  # timm.data.transforms_factory
_MAX_SIDE = 1 << 16
_MAX_CHANS = 1024
_MAX_CLASSES = 1_000_000

# ----- value checks: each returns None when fine, else what was expected -----

Check = Callable[[Any, Dict[str, Any]], Optional[str]]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _str(nonempty: bool = True) -> Check:
    return lambda v, c: None if isinstance(v, str) and (v or not nonempty) else \
        "a non-empty string" if nonempty else "a string"


def _opt(check: Check) -> Check:
    return lambda v, c: None if v is None else check(v, c)


def _int(lo: int, hi: int) -> Check:
    return lambda v, c: None if _is_int(v) and lo <= v <= hi else f"an integer in [{lo}, {hi}]"


def _bool(v, c):
    return None if isinstance(v, bool) else "true or false"


def _dict(v, c):
    return None if isinstance(v, dict) and all(isinstance(k, str) for k in v) else "a JSON object"


def _sha(v, c):
    return None if isinstance(v, str) and _SHA256.match(v) else "64 lowercase hex digits (a sha256)"


def _ints(n: Optional[int], lo: int, hi: int) -> Check:
    def check(v, c):
        ok = isinstance(v, (list, tuple)) and (n is None or len(v) == n) and all(_is_int(x) and lo <= x <= hi
                                                                                for x in v)
        return None if ok else f"a list of {n or 'some'} integers in [{lo}, {hi}]"
    return check


def _modules(v, c):  # first_conv / classifier: a module name, a list of them, or null
    ok = v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    return None if ok else "a module name, a list of module names or null"


def _kind_of(c: Dict[str, Any]) -> Any:
    prov = c.get("ttt_zoo")
    return prov.get("kind") if isinstance(prov, dict) else None


def _num_classes(v, c):
    backbone = _kind_of(c) == "backbone"
    if backbone:
        return None if v == 0 and _is_int(v) else "0 (a backbone has no classifier)"
    return None if _is_int(v) and 1 <= v <= _MAX_CLASSES else \
        f"an integer in [1, {_MAX_CLASSES}] (the classifier's rows; it must match the weights' head)"


def _same_num_classes(v, c):
    return None if v == c.get("num_classes") and _is_int(v) else f"equal to num_classes ({c.get('num_classes')!r})"


def _per_channel(rng) -> Check:  # mean / std: the range of the --mean / --std flags (ttt_zoo.flags)
    def check(v, c):
        chans = (c.get("pretrained_cfg") or {}).get("input_size", [None])[0]
        ok = isinstance(v, list) and len(v) == chans and all(_is_num(x) and not rng.problem(x) for x in v)
        return None if ok else (f"a list of {chans} numbers, each {rng.text('x')} (one per input channel of "
                                f"input_size)")
    return check


def _input_size(v, c):  # the sides: at most what a command's --img-size takes (a larger model does not fit)
    ok = isinstance(v, list) and len(v) == 3 and all(_is_int(x) and x >= 1 for x in v)
    ok = ok and v[0] <= _MAX_CHANS and max(v[1:]) <= MAX_IMG_SIDE
    return None if ok else f"[channels, height, width] with channels in [1, {_MAX_CHANS}] and sides in [1, " \
                           f"{MAX_IMG_SIDE}]"


def _interpolation(v, c):
    from timm.data.transforms import _str_to_pil_interpolation  # timm's names ('random' picks one when training)
    names = sorted(_str_to_pil_interpolation) + ["random"]
    if _kind_of(c) == "diffusion":
        names.append("")  # latents: no image resizing
    return None if v in names else f"one of {', '.join(repr(n) for n in names)}"


def _crop_pct(v, c):
    return None if _is_num(v) and not CROP_PCT.problem(v) else f"a number {CROP_PCT.text('x')}{CROP_PCT.hint}"


def _tag(v, c):
    return None if v is None or (isinstance(v, str) and _TAG.match(v)) else "letters, digits, '_' and '-'"


def _label_names(v, c):
    names = list(v.values()) if isinstance(v, dict) else v  # timm also takes {class index: name} (some classes)
    n = c.get("num_classes") or 0
    ok = isinstance(names, list) and all(isinstance(x, str) for x in names) and (
        len(names) == n if isinstance(v, list) else all(re.fullmatch(r"\d+", k) and int(k) < n for k in v))
    return None if ok else f"a list of {c.get('num_classes')} strings (one per class), or an object of class " \
                           f"index (0 to {n - 1}) -> name"


def _label_descriptions(v, c):
    ok = isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
    return None if ok else "a JSON object of label name -> description"


def _model_args(v, c):
    if _dict(v, c):
        return "a JSON object of constructor arguments"
    other = sorted(k for k in v if k in NOT_MODEL_KWARGS)
    if other:
        return f"constructor arguments only, without {', '.join(other)} ({NOT_MODEL_KWARGS[other[0]]})"
    # timm's own save_for_hf records them too; timm's loaders setdefault them, so they must agree with what the
    # loaders derive (our writer leaves them out)
    pc = c.get("pretrained_cfg")
    size = pc.get("input_size") if isinstance(pc, dict) else None
    derived = {"num_classes": c.get("num_classes"), "in_chans": size[0] if isinstance(size, list) and size else None}
    clash = sorted(k for k in _DERIVED_ARGS if k in v and v[k] != derived[k])
    return (f"consistent with the folder's {', '.join(f'{k}={derived[k]!r}' for k in clash)} (timm's loaders take "
            f"those from num_classes and pretrained_cfg.input_size)") if clash else None


def _kind(v, c):
    return None if v in KINDS else f"one of {', '.join(KINDS)}"


def _nonneg_num(v, c):
    return None if _is_num(v) and v >= 0 else "a finite number >= 0"


# ----- the table -----

@dataclass(frozen=True)
class Key:
    """One ``config.json`` key: where it is, whether every folder has it, its check, meaning and readers."""
    path: Tuple[str, ...]
    required: bool
    check: Check
    meaning: str
    readers: Tuple[str, ...]

    @property
    def name(self) -> str:
        return ".".join(self.path)


_T, _TR, _Z = ("timm", "ttt-zoo"), ("timm", "transformers", "ttt-zoo"), ("ttt-zoo",)
KEYS: Tuple[Key, ...] = (
    Key(("architecture",), True, _str(), "registered model name (without the tag)", _TR),
    Key(("num_classes",), True, _num_classes, "classifier rows (0 for a backbone)", _TR),
    Key(("num_features",), False, _opt(_int(0, 1 << 20)), "width of the pooled features (informational)", ()),
    Key(("global_pool",), False, _str(False), "pooling of the head (informational; see pretrained_cfg)", ()),
    Key(("label_names",), False, _label_names, "class names, one per classifier row", _TR),
    Key(("label_descriptions",), False, _label_descriptions, "class name -> description", _T),
    Key(("model_args",), False, _model_args, "constructor arguments the name does not rebuild", _TR),
    Key(("pretrained_cfg",), True, _dict, "timm's pretrained cfg: preprocessing, license, paper", _T),
    Key(("pretrained_cfg", "input_size"), True, _input_size, "channels, height, width of the input", _T),
    Key(("pretrained_cfg", "mean"), True, _per_channel(MEAN), "per-channel normalisation mean", _T),
    Key(("pretrained_cfg", "std"), True, _per_channel(STD), "per-channel normalisation std (> 0)", _T),
    Key(("pretrained_cfg", "interpolation"), True, _interpolation, "resize filter", _T),
    Key(("pretrained_cfg", "crop_pct"), True, _crop_pct, "centre-crop fraction at evaluation", _T),
    Key(("pretrained_cfg", "crop_mode"), False, lambda v, c: None if v in _CROP_MODES else
        f"one of {', '.join(_CROP_MODES)}", "evaluation crop", _T),
    Key(("pretrained_cfg", "tag"), False, _tag, "the weights' tag (model.TAG)", _T),
    Key(("pretrained_cfg", "num_classes"), False, _same_num_classes, "classifier rows (as num_classes)", _T),
    Key(("pretrained_cfg", "fixed_input_size"), False, _bool, "whether the model needs input_size exactly", _T),
    Key(("pretrained_cfg", "custom_load"), False, _bool, "false: a native timm state dict", ("timm",)),
    Key(("pretrained_cfg", "pool_size"), False, _opt(_ints(None, 1, _MAX_SIDE)), "final feature-map size", _T),
    Key(("pretrained_cfg", "first_conv"), False, _modules, "stem module (for in_chans adaptation)", _T),
    Key(("pretrained_cfg", "classifier"), False, _modules, "head module (for num_classes changes)", _T),
    Key(("pretrained_cfg", "license"), False, _str(), "license of the weights", _T),
    Key(("pretrained_cfg", "paper_ids"), False, _str(), "the paper, e.g. 'arXiv:2512.01643'", _T),
    Key(("pretrained_cfg", "paper_name"), False, _str(), "the paper's title", _T),
    Key(("pretrained_cfg", "origin_url"), False, _str(), "the authors' code", _T),
    Key(("ttt_zoo",), False, _dict, "ttt-zoo's provenance block (timm and transformers ignore it)", _Z),
    Key(("ttt_zoo", "version"), False, _str(), "ttt-zoo version that converted the folder", _Z),
    Key(("ttt_zoo", "hub_id"), False, _str(), "repo id `ttt-zoo push` uploads to", _Z),
    Key(("ttt_zoo", "kind"), False, _kind, "classifier, diffusion or backbone", _Z),
    Key(("ttt_zoo", "source_file"), False, _str(), "file name of the converted checkpoint", _Z),
    Key(("ttt_zoo", "source_sha256"), False, _sha, "sha256 of that checkpoint (`push --source` checks it)", _Z),
    Key(("ttt_zoo", "source_url"), False, _opt(_str()), "where the checkpoint was downloaded from", _Z),
    Key(("ttt_zoo", "weights_sha256"), False, _sha, "sha256 of model.safetensors (checked by every loader)", _Z),
    Key(("ttt_zoo", "params"), False, _int(0, 1 << 50), "parameters, measured at conversion", _Z),
    Key(("ttt_zoo", "gmacs"), False, _opt(_nonneg_num), "GMACs per sample, measured at conversion", _Z),
    Key(("ttt_zoo", "gmacs_input"), False, _ints(None, 1, _MAX_SIDE), "input shape GMACs were measured at", _Z),
)
PRETRAINED_KEYS = tuple(k.path[1] for k in KEYS if k.path[0] == "pretrained_cfg" and len(k.path) == 2)
PROVENANCE_KEYS = tuple(k.path[1] for k in KEYS if k.path[0] == "ttt_zoo" and len(k.path) == 2)


def key_table() -> str:
    """The table as markdown (docs/hub.md)."""
    rows = ["| key | required | meaning | read by |", "| --- | --- | --- | --- |"]
    rows += [f"| `{k.name}` | {'yes' if k.required else ''} | {k.meaning} | {', '.join(k.readers) or 'nobody'} |"
             for k in KEYS]
    return "\n".join(rows)


def _lookup(cfg: Dict[str, Any], path: Tuple[str, ...]) -> Iterator[Any]:
    node: Any = cfg
    for p in path[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
    if isinstance(node, dict) and path[-1] in node:
        yield node[path[-1]]


def _timm_pretrained_fields() -> set:
    import dataclasses
    from timm.models._pretrained import PretrainedCfg
    return {f.name for f in dataclasses.fields(PretrainedCfg)}


def validate_config(cfg: Any, where: str = CONFIG_NAME, architectures: Optional[Collection[str]] = None) -> None:
    """Check every key of :data:`KEYS` present in ``cfg`` (and that the required ones are); ``architectures``: the
    names ``architecture`` may take.  Raises :class:`HubFolderError` naming the first bad key."""
    if not isinstance(cfg, dict):
        raise HubFolderError(f"{where} must hold a JSON object, got {type(cfg).__name__}. Re-run `ttt-zoo convert`.")
    missing = [k.name for k in KEYS if k.required and not list(_lookup(cfg, k.path))
               and (len(k.path) == 1 or isinstance(cfg.get(k.path[0]), dict))]  # a non-object parent: its type
    if missing:
        raise HubFolderError(
            f"{where} is missing required field(s) {', '.join(repr(m) for m in missing)}; timm needs them to "
            f"build the model and its preprocessing. Re-run `ttt-zoo convert` to write a complete config.json.")
    for key in KEYS:
        for value in _lookup(cfg, key.path):
            expected = key.check(value, cfg)
            if expected:
                shown = json.dumps(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise HubFolderError(f"{where}: '{key.name}' is {shown}; it must be {expected}. Re-run "
                                     f"`ttt-zoo convert` (or correct the key).")
    unknown = sorted(set(cfg["pretrained_cfg"]) - _timm_pretrained_fields())
    if unknown:  # timm builds a PretrainedCfg from the whole object and fails on any other key
        raise HubFolderError(f"{where}: 'pretrained_cfg.{unknown[0]}' is not a field of timm's PretrainedCfg; remove "
                             f"it (or re-run `ttt-zoo convert`).")
    if architectures is not None and cfg["architecture"] not in architectures:
        raise HubFolderError(f"{where}: 'architecture' {cfg['architecture']!r} is not a ttt-zoo model (see "
                             f"`ttt-zoo list`).")


def read_config(folder: str, architectures: Optional[Collection[str]] = None) -> Dict[str, Any]:
    """Read and validate ``folder/config.json`` (see :func:`validate_config`)."""
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(path):
        raise HubFolderError(f"{folder} has no {CONFIG_NAME}. Create the folder with `ttt-zoo convert`.")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except UnicodeDecodeError as e:
        raise HubFolderError(f"{path} is not UTF-8 text (byte {e.start}). Re-run `ttt-zoo convert`.") from e
    except json.JSONDecodeError as e:
        raise HubFolderError(f"{path} is not valid JSON ({e}). Re-run `ttt-zoo convert`.") from e
    except RecursionError as e:
        raise HubFolderError(f"{path} is nested too deeply to be a config.json. Re-run `ttt-zoo convert`.") from e
    except OSError as e:
        raise HubFolderError(f"Cannot read {path}: {e.strerror or e}.") from e
    validate_config(cfg, path, architectures)
    return cfg


def write_config(folder: str, cfg: Dict[str, Any], architectures: Optional[Collection[str]] = None) -> str:
    """Validate ``cfg`` as the reader does and write it as ``folder/config.json`` (atomically); returns the path."""
    path = os.path.join(folder, CONFIG_NAME)
    validate_config(cfg, path, architectures)
    atomic_write(path, json.dumps(cfg, indent=2))
    return path


def check_weights(folder: str, cfg: Dict[str, Any]) -> None:
    """Refuse weights whose sha256 differs from the one the folder records (folders converted before the sha256
    was recorded have none: nothing to check)."""
    want = provenance(cfg).get("weights_sha256")
    path = os.path.join(folder, WEIGHTS_NAME)
    if want and os.path.isfile(path) and sha256_file(path) != want:
        raise HubFolderError(f"{path} does not match the sha256 its config.json records ('ttt_zoo.weights_sha256' "
                             f"{want[:16]}...): the file was changed or damaged. Download or convert it again.")


# ----- accessors (so that no other module spells a key) -----

def architecture(cfg: Dict[str, Any]) -> str:
    return cfg["architecture"]


def provenance(cfg: Dict[str, Any]) -> Dict[str, Any]:
    return cfg.get("ttt_zoo") or {}


def num_classes(cfg: Dict[str, Any]) -> int:
    return cfg["num_classes"]


def hub_id(cfg: Dict[str, Any]) -> Optional[str]:
    return provenance(cfg).get("hub_id")


def source(cfg: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """(file name, sha256) of the checkpoint the folder was converted from, as recorded."""
    prov = provenance(cfg)
    return prov.get("source_file"), prov.get("source_sha256")


def kind(cfg: Dict[str, Any]) -> str:
    return provenance(cfg).get("kind", "classifier")


def model_name(cfg: Dict[str, Any]) -> str:
    """'vit3_tiny.digits': the architecture with the pretrained cfg's tag."""
    tag = cfg["pretrained_cfg"].get("tag")
    return cfg["architecture"] + (f".{tag}" if tag else "")


def model_args(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """``model_args`` without the loader arguments (checked to agree with :func:`loader_args` on reading)."""
    return {k: v for k, v in (cfg.get("model_args") or {}).items() if k not in _DERIVED_ARGS}


def input_size(cfg: Dict[str, Any]) -> Tuple[int, ...]:
    return tuple(cfg["pretrained_cfg"]["input_size"])


def paper_ids(cfg: Dict[str, Any]) -> Any:
    return cfg["pretrained_cfg"].get("paper_ids")


def loader_args(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The constructor arguments timm's loaders take from ``num_classes`` and ``pretrained_cfg.input_size`` (what
    ``timm.create_model('local-dir:...')`` passes besides ``model_args``)."""
    return dict(num_classes=cfg["num_classes"], in_chans=cfg["pretrained_cfg"]["input_size"][0])


# ----- building a config (the writer's input) -----

def timm_config(model: Any, used_args: Dict[str, Any], labels: Dict[str, Any], prov: Dict[str, Any],
                data_config: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """timm's ``save_config_for_hf`` layout for ``model``, with ``model_args`` cut to what the model name cannot
    rebuild (timm records the :data:`LOADER_ARGS`, and the default ``img_size``, there too, which clients that pass
    them refuse) and the ``ttt_zoo`` block ``prov``.  ``labels``: ``label_names`` / ``label_descriptions`` or {}."""
    import tempfile
    from timm.models._hub import save_config_for_hf
    added = [a for a in ("num_features",) if not hasattr(model, a)]  # timm reads it; DiT-style models lack it
    for a in added:
        setattr(model, a, None)
    try:
        with tempfile.TemporaryDirectory() as scratch:  # timm only writes a file; its dict is read back from it
            path = os.path.join(scratch, "timm.json")
            save_config_for_hf(model, path, model_config=dict(labels, ttt_zoo=prov), data_config=data_config)
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
    finally:
        for a in added:
            delattr(model, a)
    args = {k: v for k, v in (config.pop("model_args", None) or {}).items() if k not in LOADER_ARGS}
    if "img_size" in args and "img_size" not in used_args:  # the size built from the name
        del args["img_size"]
    if "global_pool" in used_args:  # not the name's default: a constructor argument timm's loaders pass back
        args["global_pool"] = used_args["global_pool"]
    ordered = {}
    for k, v in config.items():  # timm's key order: model_args before pretrained_cfg
        if k == "pretrained_cfg" and args:
            ordered["model_args"] = args
        ordered[k] = v
    return ordered


def plain_config(arch: str, args: Dict[str, Any], pretrained_cfg: Dict[str, Any],
                 prov: Dict[str, Any]) -> Dict[str, Any]:
    """The layout for a non-timm architecture (a backbone: no classifier): the same keys, ``num_classes`` 0."""
    args = json.loads(json.dumps({k: v for k, v in args.items() if k not in LOADER_ARGS}, default=list))
    pc = json.loads(json.dumps({k: v for k, v in pretrained_cfg.items() if v is not None}, default=list))
    return dict(architecture=arch, num_classes=0, **({"model_args": args} if args else {}), pretrained_cfg=pc,
                ttt_zoo=prov)


def with_weights_sha256(prov: Dict[str, Any], folder: str) -> Dict[str, Any]:
    """``prov`` with the sha256 of ``folder/model.safetensors``."""
    return dict(prov, weights_sha256=sha256_file(os.path.join(folder, WEIGHTS_NAME)))
