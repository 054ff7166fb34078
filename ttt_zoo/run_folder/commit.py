"""Committing an epoch's files as one set, and checking every committed file a reader is handed (see
:mod:`ttt_zoo.run_folder`).

An epoch's set (last.*, best.* when the epoch is best, run.json, summary.csv) is committed by :func:`commit_epoch`
in three steps:

1. every file is written to ``<name>.tmp`` and fsync'ed (best.* are byte copies of last.*);
2. ``checkpoint.json`` (epoch, best epoch, each committed file's sha256) is written to a temp file, fsync'ed and
   renamed: this single rename is the commit;
3. the temps are renamed onto their public names (roll forward).

A kill before step 2 leaves the previous epoch's set untouched (its temps are deleted at the next start); a kill
during step 3 is finished at the next start by :func:`recover`, which trusts only what the manifest names and checks
every hash. Readers get a committed file only through :func:`committed_file` (at the path given and at its real
path), the one place that checks a hash.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, List, Optional

from ttt_zoo.errors import CheckpointError, FolderInUseError
from ttt_zoo.fileio import NORMAL_MODE, folder_lock, fsync_dir, fsync_file, replace_file, sha256_file, write_file

from .layout import (MANIFEST, MANIFEST_FORMAT, RECORD, SUMMARY, TMP, commit_names, family, manifest_path,
                     state_name, state_path, tag_of, weights_name, weights_path)

STATE_FORMAT = "ttt_zoo.train/1"  # a <tag>.state.pt

__all__ = ["STATE_FORMAT", "commit_epoch", "read_manifest", "committed_epoch", "publish", "is_stale_temp", "remove_stale_temps",
           "recover", "committed_weights", "committed_file"]


def _weights_to_save(sd: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def commit_epoch(folder: str, state: Dict[str, Any], model_sd: Dict[str, Any],
                 ema_sd: Optional[Dict[str, Any]] = None, metadata: Optional[Dict[str, str]] = None,
                 best: bool = False, summary_csv: Optional[str] = None,
                 record: Optional[Dict[str, Any]] = None) -> None:
    """Commit one epoch as a set: ``last.state.pt`` (``state`` + the weights), ``last[_ema].safetensors``, their
    ``best.*`` copies when ``best``, the run record ``run.json`` (``record``) and ``summary.csv`` (its whole text)
    -- all or nothing (see the module doc)."""
    import torch
    from safetensors.torch import save_file
    epoch = int(state["epoch"])
    model_sd = _weights_to_save(model_sd)
    ema_sd = _weights_to_save(ema_sd) if ema_sd is not None else None
    state = dict(state, format=STATE_FORMAT, model=model_sd, model_ema=ema_sd)
    meta = {k: str(v) for k, v in (metadata or {}).items()}

    writers = [(state_name("last"), lambda p: torch.save(state, p))]
    if ema_sd is not None:
        writers.append((weights_name("last", ema=True), lambda p: save_file(ema_sd, p, metadata=meta)))
    writers.append((weights_name("last"), lambda p: save_file(model_sd, p, metadata=meta)))
    if best:  # byte copies of last.*: best always holds exactly the weights of the epoch the state calls best
        writers += [("best" + n[len("last"):], lambda p, n=n: shutil.copyfile(os.path.join(folder, n + TMP), p))
                    for n, _ in list(writers)]
    if record is not None:
        writers.append((RECORD, lambda p: write_file(p, json.dumps(record, indent=1) + "\n")))
    if summary_csv is not None:
        writers.append((SUMMARY, lambda p: write_file(p, summary_csv)))

    previous = read_manifest(folder)
    written: Dict[str, str] = {}
    for name, write in writers:  # 1. temps
        tmp = os.path.join(folder, name + TMP)
        try:
            write(tmp)
        except OSError as e:  # e.g. a full disk: the previous epoch stays committed, this one's temps are cleaned
            kept_epoch = previous.get("epoch") if previous else None  # at the next start
            raise OSError(e.errno, f"{e.strerror or e} while committing epoch {epoch}; " + (
                f"epoch {kept_epoch} stays committed: continue with `ttt-zoo train --resume {folder}`"
                if kept_epoch is not None else "no epoch was committed yet"), os.path.join(folder, name)) from e
        os.chmod(tmp, NORMAL_MODE)  # safetensors' save_file creates its file private (0600)
        fsync_file(tmp)
        written[name] = sha256_file(tmp)
    rewritten = {family(n) for n in written}
    kept: Dict[str, str] = {}  # the previous best.* stay committed unless this epoch rewrites them
    if previous is not None:
        kept = {n: h for n, h in previous["files"].items() if family(n) not in rewritten}
    else:  # the first commit in a folder from before manifests: name its files as they are
        for n in commit_names()[:-1]:
            if family(n) not in rewritten and os.path.isfile(os.path.join(folder, n)):
                kept[n] = sha256_file(os.path.join(folder, n))
    manifest = {"format": MANIFEST_FORMAT, "epoch": epoch, "best_epoch": state.get("best_epoch"),
                "files": dict(written, **kept)}
    tmp = manifest_path(folder) + TMP
    write_file(tmp, lambda f: json.dump(manifest, f, indent=1))  # 2. the commit
    replace_file(tmp, manifest_path(folder))
    publish(folder, list(written))  # 3. roll forward


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
