"""What a run recorded (its arguments and its record ``run.json``), and the one resolver of ``--checkpoint`` and
``--resume`` every command that reads a run uses (see :mod:`ttt_zoo.run_folder`)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ttt_zoo.errors import CheckpointError

from .commit import STATE_FORMAT, committed_epoch, committed_file, committed_weights, read_manifest
from .layout import (ARGS, LOG, MANIFEST, RECORD, RUN_WEIGHTS, is_run_folder, resume_args_names,
                     state_file_of, state_name, state_path, tag_of, weights_name, weights_path)

__all__ = ["read_record", "recorded_args", "find_weights", "RUN_DEFAULTS", "ResolvedCheckpoint",
           "resolve_checkpoint", "apply_run_defaults", "run_model_kwargs", "resolve_resume", "load_state"]


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
    out: Dict[str, Any] = {}
    for name in [ARGS] + resume_args_names(folder):
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

    def img_size(self, model: Optional[str]) -> Optional[Tuple[int, int]]:
        """(H, W) the run trained at, for the run's own model (None: not recorded, or another model)."""
        side = self.record.get("img_size") if self.same_model(model) else None
        if not side:
            return None
        return tuple(side) if isinstance(side, (list, tuple)) else (side, side)

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


def _state_epoch(path: str) -> int:
    return int(load_state(path)["epoch"])


def resolve_resume(path: str) -> Tuple[str, Optional[str]]:
    """``--resume PATH`` (the run folder, its ``last.state.pt``, or a ``.safetensors`` sibling) -> (run folder, the
    state to resume), or (run folder, None) for a run that committed nothing yet and that is restarted from its
    args.yaml.  Anything but the run's latest commit is refused: a resume never moves a run backwards."""
    from ttt_zoo.fileio import LOCK_NAME
    from .commit import is_stale_temp
    given = path
    if os.path.isdir(path):
        folder, name = os.path.abspath(path), state_name("last")
    else:
        folder, name = os.path.split(os.path.abspath(state_file_of(path)))
    if not os.path.isdir(folder) or not os.path.exists(given) and tag_of(os.path.basename(given)) is None:
        raise CheckpointError(f"--resume {given}: no such run folder; give the folder of a `ttt-zoo train` run (or "
                              f"its {state_name('last')}).")
    latest = committed_epoch(folder)
    if latest is None:  # nothing committed: restart from args.yaml
        if not os.path.isfile(os.path.join(folder, ARGS)):
            if set(os.listdir(folder)) - {LOG, LOCK_NAME} - {n for n in os.listdir(folder) if is_stale_temp(n)}:
                raise CheckpointError(f"--resume {given}: {folder} is not a `ttt-zoo train` run folder (it has no "
                                      f"{ARGS} and no {MANIFEST}); give the folder of a run.")
            raise CheckpointError(f"--resume {given}: the run in {folder} was stopped before it wrote its {ARGS}, "
                                  f"so there is nothing to resume; run the command that started it again (it "
                                  f"starts again in this folder).")
        if name != state_name("last"):
            raise CheckpointError(f"--resume {given}: no epoch of the run in {folder} was committed yet, so there is "
                                  f"no {name}; restart the run with `ttt-zoo train --resume {folder}`.")
        return folder, None
    tag, manifest = tag_of(name), read_manifest(folder)
    if manifest is not None and name not in manifest["files"] or tag is None:
        raise CheckpointError(f"--resume {given}: {name} is not a training state committed in {folder}; continue "
                              f"the run with `ttt-zoo train --resume {folder}`.")
    if tag != "last":  # the latest commit is last.*; best.* is it only when the latest epoch was the best
        last, this = latest, None
        if manifest is not None:
            best_epoch = manifest.get("best_epoch")
            this = None if best_epoch is None else int(best_epoch) + 1
        else:
            last, this = _state_epoch(state_path(folder, "last")), _state_epoch(os.path.join(folder, name))
        if this != last:
            raise CheckpointError(
                f"--resume {given}: that is epoch {this} of the run, but {folder} has committed epoch {last}; "
                f"resuming it would move the run back and overwrite the later epochs. To continue the run: "
                f"`ttt-zoo train --resume {folder}`; to start a new run from those weights: `ttt-zoo train ... "
                f"--initial-checkpoint {weights_path(folder, tag)} --experiment NEW`")
    return folder, state_path(folder, "last")


def load_state(path: str) -> Dict[str, Any]:
    from ttt_zoo.checkpoint import safe_torch_load
    state = safe_torch_load(path)
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path!r} is not a ttt-zoo training state (format {STATE_FORMAT!r}); to start from plain "
                              f"weights use --initial-checkpoint instead of --resume.")
    return state
