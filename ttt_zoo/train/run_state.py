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
during step 3 is finished at the next start by :func:`recover`, which trusts only what the manifest names and
checks every hash.  A folder without a manifest (written before it existed) is read as before.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ttt_zoo.checkpoint import CheckpointError, safe_torch_load
from ttt_zoo.fileio import fsync_dir, fsync_file, replace_file, sha256_file, write_file

__all__ = ["FORMAT", "MANIFEST", "commit_epoch", "recover", "read_manifest", "load_state", "resolve_resume",
           "rng_state", "set_rng_state", "check_output_dir", "estimate_checkpoint_bytes", "state_path",
           "weights_path", "manifest_path", "committed_weights", "TAGS", "SUMMARY"]

FORMAT = "ttt_zoo.train/1"
MANIFEST = "checkpoint.json"
MANIFEST_FORMAT = "ttt_zoo.train.commit/1"
SUMMARY = "summary.csv"
TAGS = ("last", "best")
TMP = ".tmp"  # suffix of a file written but not yet committed / published
_PAUSE_ENV = "TTT_ZOO_TEST_SAVE_PAUSE"  # tests only: "<epoch>:<stage>" pauses inside that commit (see _test_pause)


def state_path(folder: str, tag: str) -> str:
    return os.path.join(folder, f"{tag}.state.pt")


def weights_path(folder: str, tag: str, ema: bool = False) -> str:
    return os.path.join(folder, f"{tag}{'_ema' if ema else ''}.safetensors")


def manifest_path(folder: str) -> str:
    return os.path.join(folder, MANIFEST)


def _commit_names() -> List[str]:
    """Every public name a commit may write (their ``.tmp`` siblings are ours to clean)."""
    return [f"{t}{s}" for t in TAGS for s in (".state.pt", "_ema.safetensors", ".safetensors")] + [SUMMARY, MANIFEST]


def _family(name: str) -> str:
    """'last' / 'best' for a checkpoint file name, else the name's stem ('summary')."""
    return name.split(".")[0].split("_")[0]


def _test_pause(epoch: int, stage: str, folder: str) -> None:
    """Test hook: with ``TTT_ZOO_TEST_SAVE_PAUSE=<epoch>:<stage>`` the commit of that epoch writes a marker file
    ``SAVE_PAUSED`` (holding ``stage``) and sleeps there, so a test can SIGKILL the process at that point.

    Stages, in order: ``wrote:<name>`` (that temp file complete), ``written`` (all temps and the manifest's temp
    complete, nothing renamed), ``committed`` (the manifest renamed), ``renamed:<name>`` (that file published;
    ``renamed`` is the first, ``last.state.pt``), ``published`` (all published)."""
    want = os.environ.get(_PAUSE_ENV, "")
    if want and want == f"{epoch}:{stage}":
        with open(os.path.join(folder, "SAVE_PAUSED"), "w") as f:
            f.write(stage)
        time.sleep(600)


def _weights_to_save(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def read_manifest(folder: str) -> Optional[Dict[str, Any]]:
    """The folder's ``checkpoint.json`` (None when there is none: a run from before manifests, or nothing
    committed yet)."""
    path = manifest_path(folder)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable commit manifest ({e}).") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"{path} is not a ttt-zoo commit manifest (format {MANIFEST_FORMAT!r}).")
    return data


def _publish(folder: str, names: List[str], epoch: Optional[int]) -> None:
    """Rename each committed ``<name>.tmp`` onto ``<name>``, in order (the state first)."""
    for i, name in enumerate(names):
        replace_file(os.path.join(folder, name + TMP), os.path.join(folder, name))
        if epoch is not None:
            if i == 0:
                _test_pause(epoch, "renamed", folder)
            _test_pause(epoch, f"renamed:{name}", folder)
    if epoch is not None:
        _test_pause(epoch, "published", folder)


def commit_epoch(folder: str, state: Dict[str, Any], model_sd: Dict[str, torch.Tensor],
                 ema_sd: Optional[Dict[str, torch.Tensor]] = None, metadata: Optional[Dict[str, str]] = None,
                 best: bool = False, summary_csv: Optional[str] = None) -> None:
    """Commit one epoch as a set: ``last.state.pt`` (``state`` + the weights), ``last[_ema].safetensors``, their
    ``best.*`` copies when ``best``, and ``summary.csv`` (its whole text) -- all or nothing (see the module doc)."""
    from safetensors.torch import save_file
    epoch = int(state["epoch"])
    model_sd = _weights_to_save(model_sd)
    ema_sd = _weights_to_save(ema_sd) if ema_sd is not None else None
    state = dict(state, format=FORMAT, model=model_sd, model_ema=ema_sd)
    meta = {k: str(v) for k, v in (metadata or {}).items()}

    writers = [("last.state.pt", lambda p: torch.save(state, p))]
    if ema_sd is not None:
        writers.append(("last_ema.safetensors", lambda p: save_file(ema_sd, p, metadata=meta)))
    writers.append(("last.safetensors", lambda p: save_file(model_sd, p, metadata=meta)))
    if best:  # byte copies of last.*: best always holds exactly the weights of the epoch the state calls best
        writers += [("best" + n[len("last"):], lambda p, n=n: shutil.copyfile(os.path.join(folder, n + TMP), p))
                    for n, _ in list(writers)]
    if summary_csv is not None:
        writers.append((SUMMARY, lambda p: write_file(p, summary_csv)))

    previous = read_manifest(folder)
    written: Dict[str, str] = {}
    for name, write in writers:  # 1. temps
        tmp = os.path.join(folder, name + TMP)
        write(tmp)
        fsync_file(tmp)
        written[name] = sha256_file(tmp)
        _test_pause(epoch, f"wrote:{name}", folder)
    rewritten = {_family(n) for n in written}
    kept: Dict[str, str] = {}  # the previous best.* stay committed unless this epoch rewrites them
    if previous is not None:
        kept = {n: h for n, h in previous["files"].items() if _family(n) not in rewritten}
    else:  # the first commit in a folder from before manifests: name its files as they are
        for n in _commit_names()[:-1]:
            if _family(n) not in rewritten and os.path.isfile(os.path.join(folder, n)):
                kept[n] = sha256_file(os.path.join(folder, n))
    manifest = {"format": MANIFEST_FORMAT, "epoch": epoch, "best_epoch": state.get("best_epoch"),
                "files": dict(written, **kept)}
    tmp = manifest_path(folder) + TMP
    write_file(tmp, lambda f: json.dump(manifest, f, indent=1))  # 2. the commit
    _test_pause(epoch, "written", folder)
    replace_file(tmp, manifest_path(folder))
    _test_pause(epoch, "committed", folder)
    _publish(folder, list(written), epoch)  # 3. roll forward


def recover(folder: str) -> Optional[Dict[str, Any]]:
    """At the start of a run on ``folder`` (its lock held): finish a commit that was cut off after its manifest
    landed, check every committed file against its sha256, and delete the temps of a commit that never landed.
    Returns the manifest (None for a folder without one). A committed file that is missing or differs raises."""
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
        _publish(folder, pending, None)
    for name in _commit_names():  # what is left over was never committed
        leftover = os.path.join(folder, name + TMP)
        if os.path.isfile(leftover):
            os.remove(leftover)
    fsync_dir(folder)
    return manifest


def committed_weights(folder: str, which: str = "best", ema: bool = False) -> Optional[str]:
    """The ``<which>[_ema].safetensors`` a reader of the run folder may load: the file its manifest commits.

    Without a manifest (a folder from before manifests): the public path if it exists, else None.  With one: None
    when the manifest commits no such file; the public path when its sha256 is the committed one; when only the
    pending ``.tmp`` matches (a run killed while publishing), the folder's lock is taken without waiting and
    :func:`recover` publishes it.  Raises :class:`CheckpointError` while a live run is publishing (retry), and for
    a file that matches neither.  Only the requested file is hashed (all of them when it recovers)."""
    from ttt_zoo.fileio import FolderInUseError, folder_lock
    name = os.path.basename(weights_path(folder, which, ema))
    public = os.path.join(folder, name)
    for _ in range(2):  # a live run may commit the next epoch while we look: then look once more
        manifest = read_manifest(folder)
        if manifest is None:
            return public if os.path.isfile(public) else None
        digest = manifest["files"].get(name)
        if digest is None:
            return None
        if os.path.isfile(public) and sha256_file(public) == digest:
            return public
        if os.path.isfile(public + TMP) and sha256_file(public + TMP) == digest:  # committed, not yet published
            try:
                with folder_lock(folder, "ttt-zoo reader"):
                    recover(folder)
            except FolderInUseError:
                raise CheckpointError(f"{folder}: a training run is committing epoch {manifest.get('epoch')} "
                                      f"right now ({name} is not yet in place); retry in a moment.") from None
            except OSError as e:
                raise CheckpointError(f"{public}: epoch {manifest.get('epoch')} was committed but not yet put in "
                                      f"place, and the folder cannot be locked to finish it ({e.strerror or e}); run "
                                      f"`ttt-zoo train --resume {folder}` from an account that can write it.") from None
            return public
        if read_manifest(folder) == manifest:
            break
    raise CheckpointError(f"{public} is missing or differs from what {manifest_path(folder)} committed (epoch "
                          f"{manifest.get('epoch')}): the file was corrupted or changed; restore it, or load "
                          f"another checkpoint.")


def resolve_resume(path: str) -> str:
    """``--resume`` may name the experiment folder, a ``*.state.pt`` file or its ``.safetensors`` sibling."""
    if os.path.isdir(path):
        path = state_path(path, "last")
    elif path.endswith(".safetensors"):
        path = path[: -len(".safetensors")].removesuffix("_ema") + ".state.pt"
    folder, name = os.path.split(os.path.abspath(path))
    manifest = read_manifest(folder) if os.path.isdir(folder) else None
    committed = manifest is not None and name in manifest["files"]  # maybe not yet published: recover() does
    if not os.path.isfile(path) and not committed:
        raise CheckpointError(f"--resume {path!r}: no such training state. Give the experiment folder or its "
                              f"last.state.pt / best.state.pt.")
    return path


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
