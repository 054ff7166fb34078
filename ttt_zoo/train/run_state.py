"""Training state of a run folder (its last/best state and weight files and the ``checkpoint.json`` epoch
manifest), committed one epoch at a time as a set, so that nothing is ever lost.  (Weight files in general are
:mod:`ttt_zoo.checkpoint`; activation recomputation is "grad checkpointing", see :mod:`ttt_zoo.layers.recompute`.)

Per tag (``last``, ``best``) in the experiment folder:

    <tag>.state.pt          everything exact resume needs, one file, ``torch.load(weights_only=True)``-loadable:
                            model and EMA weights, optimizer, scheduler, AMP scaler, task state, every rank's RNG
                            states (python / numpy / torch / cuda), epoch, update count, best metric, args
    <tag>.safetensors       the model's weights (what ``ttt-zoo validate`` / ``timm.create_model`` load)
    <tag>_ema.safetensors   the EMA weights, only with --model-ema (a separate file, same key names)

plus ``summary.csv`` and the manifest ``checkpoint.json``.  An epoch's set (last.*, best.* when the epoch is best,
summary.csv) is committed by :func:`commit_epoch` in three steps:

1. every file is written to ``<name>.tmp`` and fsync'ed (best.* are byte copies of last.*);
2. ``checkpoint.json`` (epoch, best epoch, each committed file's sha256) is written to a temp file, fsync'ed and
   renamed: this single rename is the commit;
3. the temps are renamed onto their public names (roll forward).

A kill before step 2 leaves the previous epoch's set untouched (its temps are deleted at the next start); a kill
during step 3 is finished at the next start by :func:`~ttt_zoo.run_folder.recover`, which trusts only what the
manifest names and checks every hash.  A folder without a manifest (written before it existed) is read as before.
The folder's file names, its manifest and every reader of it are :mod:`ttt_zoo.run_folder`.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from ttt_zoo.checkpoint import CheckpointError, safe_torch_load
from ttt_zoo.fileio import _NORMAL_MODE as NORMAL_MODE, fsync_file, replace_file, sha256_file, write_file
from ttt_zoo.run_folder import (  # noqa: F401  (the names the tests and older callers use, re-exported)
    MANIFEST, MANIFEST_FORMAT, RECORD, SUMMARY, TAGS, TMP, commit_names, committed_epoch, committed_weights, family,
    manifest_path, publish, read_manifest, recover, state_file_of, state_name, state_path, weights_name, weights_path)

__all__ = ["FORMAT", "commit_epoch", "load_state", "resolve_resume", "rng_state", "set_rng_state",
           "check_output_dir", "estimate_checkpoint_bytes"]

FORMAT = "ttt_zoo.train/1"
_commit_names = commit_names  # (the tests' name for it)


def _weights_to_save(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def commit_epoch(folder: str, state: Dict[str, Any], model_sd: Dict[str, torch.Tensor],
                 ema_sd: Optional[Dict[str, torch.Tensor]] = None, metadata: Optional[Dict[str, str]] = None,
                 best: bool = False, summary_csv: Optional[str] = None,
                 record: Optional[Dict[str, Any]] = None) -> None:
    """Commit one epoch as a set: ``last.state.pt`` (``state`` + the weights), ``last[_ema].safetensors``, their
    ``best.*`` copies when ``best``, the run record ``run.json`` (``record``) and ``summary.csv`` (its whole text)
    -- all or nothing (see the module doc)."""
    from safetensors.torch import save_file
    epoch = int(state["epoch"])
    model_sd = _weights_to_save(model_sd)
    ema_sd = _weights_to_save(ema_sd) if ema_sd is not None else None
    state = dict(state, format=FORMAT, model=model_sd, model_ema=ema_sd)
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


def _state_epoch(path: str) -> int:
    return int(load_state(path)["epoch"])


def resolve_resume(path: str) -> Tuple[str, Optional[str]]:
    """``--resume PATH`` (the run folder, its ``last.state.pt``, or a ``.safetensors`` sibling) -> (run folder, the
    state to resume), or (run folder, None) for a run that committed nothing yet and that is restarted from its
    args.yaml.  Anything but the run's latest commit is refused: a resume never moves a run backwards."""
    from ttt_zoo.fileio import LOCK_NAME
    from ttt_zoo.run_folder import ARGS, LOG, is_stale_temp, tag_of
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
    state = safe_torch_load(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a ttt-zoo training state (format {FORMAT!r}); to start from plain "
                              f"weights use --initial-checkpoint instead of --resume.")
    return state


# ----- RNG -----

def rng_state() -> Dict[str, Any]:
    """This process's RNG states as tensors / plain data (``weights_only``-loadable)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(internal), gauss],
           "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: Dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----- before the first epoch -----

def estimate_checkpoint_bytes(model: torch.nn.Module, ema: bool, optimizer_slots: int = 2) -> int:
    """Bytes of one tag's files: weights in the state and in safetensors (x2 with EMA) plus optimizer slots."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    return weights * 2 * (2 if ema else 1) + params * optimizer_slots + (1 << 20)


def check_output_dir(folder: str, need_bytes: int) -> None:
    """Fail now, not after an hour: the folder must be writable (a probe file is written, fsync'ed, removed) and
    its disk must hold ``need_bytes``."""
    probe = os.path.join(folder, f".{os.getpid()}.write_probe.tmp")  # one per process: probes never collide
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise OSError(f"Output folder {folder!r} is not writable ({e.strerror or e}). Choose another --output, or "
                      f"fix its permissions / mount.") from e
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise OSError(f"Not enough free disk space in {folder!r}: checkpoints need about {need_bytes / 2**20:.1f} "
                      f"MiB (last + best + their temporary copies while saving), {free / 2**20:.1f} MiB are free. Free "
                      f"some space or choose another --output.")
