"""The run folder of ``ttt-zoo train``: its file names, its recorded arguments, its committed weights, and the one
``--checkpoint`` resolver every command that reads a run uses.

A run folder holds::

    args.yaml                   the arguments of the run's first start
    args.resume-epoch<N>.yaml   the arguments of a ``--resume`` at epoch N (they update args.yaml's)
    checkpoint.json             the commit manifest: epoch, best epoch, the sha256 of each committed file
    <tag>.state.pt              exact-resume training state (tags ``last``, ``best``)
    <tag>.safetensors           the model's weights; <tag>_ema.safetensors the EMA weights (--model-ema)
    summary.csv                 one row per committed epoch
    log.txt, train_plot.png     what a person reads

The commit itself (writing an epoch's set) is :mod:`ttt_zoo.train.run_state`; this module reads what it wrote,
finishes a commit cut off after its manifest landed (:func:`recover`), and checks every committed file it hands
out against the manifest's sha256 (:func:`committed_file`).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ttt_zoo.errors import CheckpointError, FolderInUseError
from ttt_zoo.fileio import folder_lock, fsync_dir, replace_file, sha256_file

__all__ = ["ARGS", "SUMMARY", "MANIFEST", "LOG", "PLOT", "TAGS", "TMP", "MANIFEST_FORMAT", "RUN_WEIGHTS",
           "state_path", "weights_path", "manifest_path", "resume_args_name", "commit_names", "read_manifest",
           "publish", "recover", "is_stale_temp", "remove_stale_temps", "committed_epoch", "committed_weights",
           "committed_file",
           "is_run_folder", "recorded_args", "find_weights", "ResolvedCheckpoint", "resolve_checkpoint",
           "apply_run_defaults", "run_model_kwargs", "RUN_DEFAULTS", "STATE_SUFFIX",
           "EMA_WEIGHTS_SUFFIX", "ema_weights_of", "state_name", "weights_name", "tag_of", "state_file_of",
           "RECORD", "read_record", "enclosing_run", "refuse_run_output"]

ARGS = "args.yaml"
RECORD = "run.json"  # the run record: the model as built, its classes, its data (see read_record)
RECORD_FORMAT = "ttt_zoo.run/1"
_RESUME_ARGS = "args.resume-epoch{}.yaml"
_RESUME_ARGS_RE = re.compile(r"args\.resume-epoch(\d+)\.yaml")
SUMMARY = "summary.csv"
MANIFEST = "checkpoint.json"
MANIFEST_FORMAT = "ttt_zoo.train.commit/1"
LOG = "log.txt"
PLOT = "train_plot.png"
TAGS = ("last", "best")
TMP = ".tmp"  # suffix of a file written but not yet committed / published
_STATE_SUFFIX = ".state.pt"
_WEIGHTS_SUFFIX = ".safetensors"
_EMA = "_ema"
STATE_SUFFIX, EMA_WEIGHTS_SUFFIX = _STATE_SUFFIX, _EMA + _WEIGHTS_SUFFIX
#: weights of a run folder in order of preference when a command is given the folder (EMA first, as the official
#: DiT sampler does)
RUN_WEIGHTS = tuple((tag, ema) for ema in (True, False) for tag in ("best", "last"))


def state_name(tag: str) -> str:
    return tag + _STATE_SUFFIX


def weights_name(tag: str, ema: bool = False) -> str:
    return tag + (_EMA if ema else "") + _WEIGHTS_SUFFIX


def state_path(folder: str, tag: str) -> str:
    return os.path.join(folder, state_name(tag))


def weights_path(folder: str, tag: str, ema: bool = False) -> str:
    return os.path.join(folder, weights_name(tag, ema))


def manifest_path(folder: str) -> str:
    return os.path.join(folder, MANIFEST)


def resume_args_name(epoch: int) -> str:
    return _RESUME_ARGS.format(epoch)


def commit_names() -> List[str]:
    """Every public name a commit may write, in the order it writes them (their ``.tmp`` siblings are ours)."""
    return [n for t in TAGS for n in (state_name(t), weights_name(t, True), weights_name(t))] + [RECORD, SUMMARY,
                                                                                                  MANIFEST]


def family(name: str) -> str:
    """'last' / 'best' for a checkpoint file name, else the name's stem ('summary')."""
    return name.split(".")[0].split("_")[0]


def state_file_of(path: str) -> str:
    """``<tag>.state.pt`` for ``<tag>[_ema].safetensors`` (the state that holds those weights); others unchanged."""
    if path.endswith(_WEIGHTS_SUFFIX):
        return path[: -len(_WEIGHTS_SUFFIX)].removesuffix(_EMA) + _STATE_SUFFIX
    return path


def ema_weights_of(path: str) -> str:
    """``<tag>_ema.safetensors`` beside ``<tag>.safetensors`` (the EMA weights the trainer writes next to them)."""
    return path[: -len(_WEIGHTS_SUFFIX)] + EMA_WEIGHTS_SUFFIX


def tag_of(name: str) -> Optional[str]:
    """The tag of a trainer's state or weights file name (``best.state.pt`` -> 'best'), else None."""
    for tag in TAGS:
        if name in (state_name(tag), weights_name(tag), weights_name(tag, True)):
            return tag
    return None


# ----- the manifest -----

def read_manifest(folder: str) -> Optional[Dict[str, Any]]:
    """The folder's ``checkpoint.json`` (None when there is none: a run from before manifests, or nothing
    committed yet)."""
    path = manifest_path(folder)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(folder, RECORD)):  # a run of this format commits both together
            raise CheckpointError(f"{path} is missing, but {os.path.join(folder, RECORD)} shows that epochs were "
                                  f"committed in this run folder: without it no file of the run can be checked. "
                                  f"Restore {MANIFEST} (e.g. from a backup), or start a new run with "
                                  f"--initial-checkpoint.")
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable commit manifest ({e}).") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"{path} is not a ttt-zoo commit manifest (format {MANIFEST_FORMAT!r}).")
    return data


def committed_epoch(folder: str) -> Optional[int]:
    """The last epoch committed in ``folder`` (its manifest's; a folder from before manifests: 0 when it holds a
    ``last.state.pt``, whose epoch only the state knows), or None when nothing was committed."""
    manifest = read_manifest(folder)
    if manifest is not None:
        return int(manifest["epoch"])
    return 0 if os.path.isfile(state_path(folder, "last")) else None


def publish(folder: str, names: List[str]) -> None:
    """Rename each committed ``<name>.tmp`` onto ``<name>``, in order."""
    for name in names:
        replace_file(os.path.join(folder, name + TMP), os.path.join(folder, name))


_STALE_TEMP = re.compile(r"\.tmp-.+|\.\d+\.write_probe\.tmp")  # fileio's atomic temps; the trainer's write probe


def is_stale_temp(name: str, commit_only: bool = False) -> bool:
    """A half-written file's name: a commit temp, an atomic-write temp (:mod:`ttt_zoo.fileio`), a write probe
    (``commit_only``: only a commit temp)."""
    if name.endswith(TMP) and name[: -len(TMP)] in commit_names():
        return True
    return not commit_only and bool(_STALE_TEMP.fullmatch(name))


def remove_stale_temps(folder: str, commit_only: bool = False) -> List[str]:
    """Delete what a dead writer left half-written (:func:`is_stale_temp`). Call it only with the folder's lock
    held (then no live trainer owns them). Returns the names removed."""
    removed = []
    for name in sorted(os.listdir(folder)):
        if is_stale_temp(name, commit_only):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                os.remove(path)
                removed.append(name)
    return removed


def recover(folder: str, reader: bool = False) -> Optional[Dict[str, Any]]:
    """At the start of a run on ``folder`` (its lock held): finish a commit that was cut off after its manifest
    landed, check every committed file against its sha256, and delete the temps of a commit that never landed (and,
    unless a ``reader`` finishes the commit, those of any other write a dead trainer left). Returns the manifest
    (None for a folder without one). A committed file that is missing or differs raises."""
    manifest = read_manifest(folder)
    pending = []
    for name, digest in (manifest or {}).get("files", {}).items():
        public = os.path.join(folder, name)
        if os.path.isfile(public + TMP) and sha256_file(public + TMP) == digest:
            pending.append(name)  # committed, not yet published
        elif not (os.path.isfile(public) and sha256_file(public) == digest):
            raise CheckpointError(f"{public} is missing or differs from what {manifest_path(folder)} committed "
                                  f"(epoch {manifest.get('epoch')}); the run folder was changed by hand. Restore "
                                  f"the file, or start a new run with --initial-checkpoint.")
    if pending:
        publish(folder, pending)
    remove_stale_temps(folder, commit_only=reader)
    fsync_dir(folder)
    return manifest


def committed_weights(folder: str, which: str = "best", ema: bool = False) -> Optional[str]:
    """The ``<which>[_ema].safetensors`` a reader of the run folder may load (None when the run has none); see
    :func:`committed_file`."""
    path = weights_path(folder, which, ema)
    manifest = read_manifest(folder)
    if manifest is None:
        return path if os.path.isfile(path) else None
    if os.path.basename(path) not in manifest["files"]:
        return None
    return committed_file(path)


def committed_file(path: str) -> str:
    """``path``, checked against the sha256 its run folder's manifest commits for it.

    A file its folder's manifest does not name is returned as it is (a file outside a run, or a folder from before
    manifests).  When only the pending ``.tmp`` matches (a run killed while publishing), the folder's lock is taken
    without waiting and :func:`recover` publishes it.  Raises :class:`CheckpointError` while a live run is
    publishing (retry), and for a file that matches neither (corrupted or changed)."""
    for where in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):  # as given, and a link's target
        _check_committed(where, path)
    return path


def _check_committed(public: str, path: str) -> None:
    """:func:`committed_file` at one location ``public`` (absolute); ``path`` is what the user gave."""
    folder, name = os.path.split(public)
    for _ in range(2):  # a live run may commit the next epoch while we look: then look once more
        manifest = read_manifest(folder) if os.path.isdir(folder) else None
        digest = (manifest or {}).get("files", {}).get(name)
        if digest is None:
            if manifest is not None and tag_of(name):
                raise CheckpointError(f"{path} is not committed by {manifest_path(folder)}; it is not a checkpoint "
                                      f"of this run: give {weights_name('last')} or {weights_name('best')}.")
            return
        if os.path.isfile(public) and sha256_file(public) == digest:
            return
        if os.path.isfile(public + TMP) and sha256_file(public + TMP) == digest:  # committed, not yet published
            try:
                with folder_lock(folder, "ttt-zoo reader"):
                    recover(folder, reader=True)
            except FolderInUseError:
                raise CheckpointError(f"{folder}: a training run is committing epoch {manifest.get('epoch')} "
                                      f"right now ({name} is not yet in place); retry in a moment.") from None
            except OSError as e:
                raise CheckpointError(f"{public}: epoch {manifest.get('epoch')} was committed but not yet put in "
                                      f"place, and the folder cannot be locked to finish it ({e.strerror or e}); run "
                                      f"`ttt-zoo train --resume {folder}` from an account that can write it.") from None
            return
        if read_manifest(folder) == manifest:
            break
    raise CheckpointError(f"{public} is missing or differs from what {manifest_path(folder)} committed (epoch "
                          f"{manifest.get('epoch')}, sha256 {digest[:12]}...): the file was corrupted or changed; "
                          f"restore it, or load another checkpoint.")


# ----- the recorded arguments -----

def is_run_folder(folder: str) -> bool:
    """``folder`` was written by ``ttt-zoo train`` (it has its args.yaml, its record or its commit manifest)."""
    return any(os.path.isfile(os.path.join(folder, n)) for n in (ARGS, RECORD, MANIFEST))


def enclosing_run(path: str) -> Optional[str]:
    """The run folder that ``path`` is, or lies inside, by real path (symlinks followed, ``..`` resolved); None
    when it is in no run. The path itself need not exist."""
    here = os.path.realpath(path)
    while True:
        if os.path.isdir(here) and is_run_folder(here):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def refuse_run_output(path: str, flag: str) -> None:
    """Only ``ttt-zoo train`` writes into a run folder: an output ``path`` that is a run folder or lies inside one
    is refused in one line, whatever ``--force`` says."""
    from ttt_zoo.errors import UsageError
    run = enclosing_run(path)
    if run is not None:
        where = "is the run folder" if os.path.realpath(path) == run else "lies inside the run folder"
        raise UsageError(f"{flag} {path} {where} {run}; only `ttt-zoo train` writes there (--force does not "
                         f"change that): choose a path outside it")


def read_record(folder: str) -> Dict[str, Any]:
    """The run record ``run.json`` (written by ``ttt-zoo train`` with each commit): ``model`` and
    ``model_kwargs`` (the model as it was built: with ``--linearize-from``, the T5 model it became),
    ``num_classes``, ``img_size``, ``class_names`` (None for a task without classes), ``data_dir`` (an absolute
    real path), ``crop_pct``, ``task``. A run from before records: what its args.yaml says."""
    path = os.path.join(folder, RECORD)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable run record ({e}); restore the file.") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path} is not a ttt-zoo run record; restore the file.")
        return data
    args = recorded_args(folder)
    return {k: args.get(k) for k in ("model", "model_kwargs", "num_classes", "img_size", "crop_pct", "data_dir",
                                     "task")} | {"class_names": None}


def recorded_args(folder: str) -> Dict[str, Any]:
    """The arguments a run folder was trained with: args.yaml, updated by each args.resume-epoch<N>.yaml in
    epoch order (empty when the folder has none)."""
    import yaml
    resumes = sorted((int(m.group(1)), n) for n in os.listdir(folder) if (m := _RESUME_ARGS_RE.fullmatch(n)))
    out: Dict[str, Any] = {}
    for name in [ARGS] + [n for _, n in resumes]:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise CheckpointError(f"{path}: unreadable training arguments ({e}); restore the file.") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path} does not hold a mapping of training arguments; restore the file.")
        out.update(data)
    return out


def find_weights(folder: str, ema: Optional[bool] = None) -> str:
    """The weights file a command given the run folder loads, checked against the manifest: EMA weights first
    (see :data:`RUN_WEIGHTS`); ``ema`` True / False: only those."""
    order = [(t, e) for t, e in RUN_WEIGHTS if ema is None or e == ema]
    for tag, e in order:
        path = committed_weights(folder, tag, e)
        if path is not None:
            return path
    names = ", ".join(weights_name(t, e) for t, e in order)
    raise CheckpointError(f"{folder} holds none of {names}: no epoch of this run was committed yet; wait for its "
                          f"first epoch, or give a weights file.")


# ----- the one --checkpoint resolver -----

#: command flag -> the recorded argument of a run that is its default when the flag is not given
RUN_DEFAULTS = {"model": "model", "model_kwargs": "model_kwargs", "img_size": "img_size", "num_classes": "num_classes",
                "crop_pct": "crop_pct", "data_dir": "data_dir", "split": "val_split", "vae": "vae"}


@dataclass
class ResolvedCheckpoint:
    """What ``--checkpoint PATH`` names: ``weights`` (the file to load, checked against its run's manifest; None for
    a folder that is not a run, e.g. a Hub folder), the run ``folder``, its recorded arguments ``run`` and its
    :func:`read_record` ``record`` (both empty outside a run)."""
    path: str
    weights: Optional[str]
    folder: Optional[str] = None
    run: Dict[str, Any] = field(default_factory=dict)
    record: Dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> Optional[str]:
        """The registered model the run built (with ``--linearize-from``: the T5 model it became)."""
        return self.record.get("model") or self.run.get("model") or None

    @property
    def class_names(self) -> Optional[List[str]]:
        """The run's class names, in the order of its classifier's outputs (None: not recorded)."""
        names = self.record.get("class_names")
        return list(names) if names else None

    def same_model(self, model: Optional[str]) -> bool:
        """The run's own model (or none named): its recorded arguments apply; another model shares only weights."""
        return not model or model == self.model

def resolve_checkpoint(path: Optional[str], flag: str = "--checkpoint", ema: Optional[bool] = None,
                       other_folders: bool = False) -> ResolvedCheckpoint:
    """``--checkpoint PATH`` -> :class:`ResolvedCheckpoint`: a run folder gives its committed weights
    (:func:`find_weights`, ``ema`` as there) and its :func:`recorded_args`; a file gives itself, checked against
    its folder's manifest (:func:`committed_file`), and the recorded arguments of the run it is in.  A folder that
    is no run is refused, unless ``other_folders`` (the caller reads it, e.g. a Hub folder: ``weights`` is None)."""
    if not path:
        return ResolvedCheckpoint(path or "", None)
    folder = os.path.dirname(os.path.abspath(path))
    pending = not os.path.exists(path) and os.path.basename(path) in ((read_manifest(folder) or {}).get("files", {})
                                                                      if os.path.isdir(folder) else {})
    if not os.path.exists(path) and not pending:  # (a committed file not yet put in place: committed_file does)
        raise CheckpointError(f"{flag} {path} does not exist; give a weights file (.safetensors, .pth, .pt) or a "
                              f"`ttt-zoo train` run folder")
    if os.path.isdir(path):
        if not is_run_folder(path):
            if other_folders:
                return ResolvedCheckpoint(path, None)
            raise CheckpointError(f"{flag} {path} is a folder, not a weights file or a `ttt-zoo train` run folder "
                                  f"(it has no {ARGS} or {MANIFEST}); give a weights file (.safetensors, .pth, .pt) "
                                  f"or a run folder")
        return ResolvedCheckpoint(path, find_weights(path, ema), path, recorded_args(path), read_record(path))
    if not is_run_folder(folder):
        return ResolvedCheckpoint(path, committed_file(path))
    return ResolvedCheckpoint(path, committed_file(path), folder, recorded_args(folder), read_record(folder))


def apply_run_defaults(args: Any, resolved: ResolvedCheckpoint, flags, always=()) -> None:
    """Set each of ``flags`` (see :data:`RUN_DEFAULTS`) that ``args`` leaves unset from the run's recorded
    arguments: all of them for the run's own model, only those in ``always`` for another model."""
    same = resolved.same_model(getattr(args, "model", None))
    for flag in flags:
        key = RUN_DEFAULTS[flag]
        value = resolved.record.get(key)
        if value in (None, {}, ""):
            value = resolved.run.get(key)
        if (same or flag in always) and getattr(args, flag, None) in (None, {}, "") and value not in (None, {}, ""):
            setattr(args, flag, value)


def run_model_kwargs(resolved: ResolvedCheckpoint, model: Optional[str], given: Dict[str, Any],
                     with_img_size: bool = True) -> Dict[str, Any]:
    """The constructor arguments of the run's model (its --model-kwargs, and its --img-size as ``img_size``),
    updated by ``given``; only ``given`` for another model."""
    if not resolved.folder or not resolved.same_model(model):
        return dict(given)
    rec = resolved.record
    out = dict(rec.get("model_kwargs") or {})
    if rec.get("num_classes") is not None and "num_classes" not in out:
        out["num_classes"] = rec["num_classes"]
    if with_img_size and rec.get("img_size") and "img_size" not in out:
        out["img_size"] = rec["img_size"]
    out.update(given)
    return out
