"""Checkpoint files of a training run, written so that nothing is ever lost.

Per tag (``last``, ``best``) in the experiment folder:

    <tag>.state.pt          everything exact resume needs, one file, ``torch.load(weights_only=True)``-loadable:
                            model and EMA weights, optimizer, scheduler, AMP scaler, task state, every rank's RNG
                            states (python / numpy / torch / cuda), epoch, update count, best metric, args
    <tag>.safetensors       the model's weights (what ``ttt-zoo validate`` / ``timm.create_model`` load)
    <tag>_ema.safetensors   the EMA weights, only with --model-ema (a separate file, same key names)

Every file is written to ``<name>.tmp``, flushed and fsync'ed, then renamed with ``os.replace``.  The state is
renamed first and the weights after it, so a weights file is never newer than the state beside it, and resume
reads only the (self-contained) state.  A kill at any point leaves the previous files complete and loadable.
"""
from __future__ import annotations

import os
import random
import shutil
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ttt_zoo.checkpoint import CheckpointError, safe_torch_load
from ttt_zoo.fileio import fsync_dir

__all__ = ["FORMAT", "save_checkpoint", "copy_checkpoint", "load_state", "resolve_resume", "rng_state",
           "set_rng_state", "check_output_dir", "estimate_checkpoint_bytes", "state_path", "weights_path"]

FORMAT = "ttt_zoo.train/1"
_PAUSE_ENV = "TTT_ZOO_TEST_SAVE_PAUSE"  # tests only: "<epoch>:<stage>" pauses inside that save (see _test_pause)


def state_path(folder: str, tag: str) -> str:
    return os.path.join(folder, f"{tag}.state.pt")


def weights_path(folder: str, tag: str, ema: bool = False) -> str:
    return os.path.join(folder, f"{tag}{'_ema' if ema else ''}.safetensors")


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _test_pause(epoch: int, stage: str, folder: str) -> None:
    """Test hook: with ``TTT_ZOO_TEST_SAVE_PAUSE=<epoch>:<stage>`` the save of that epoch writes a marker file
    and sleeps at ``stage`` ('written': temp files complete, nothing renamed; 'renamed': state renamed, weights
    not yet), so a test can SIGKILL the process there."""
    want = os.environ.get(_PAUSE_ENV, "")
    if want and want == f"{epoch}:{stage}":
        with open(os.path.join(folder, "SAVE_PAUSED"), "w") as f:
            f.write(stage)
        time.sleep(600)


def _weights_to_save(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save_checkpoint(folder: str, tag: str, state: Dict[str, Any], model_sd: Dict[str, torch.Tensor],
                    ema_sd: Optional[Dict[str, torch.Tensor]] = None, metadata: Optional[Dict[str, str]] = None
                    ) -> None:
    """Write ``<tag>.state.pt`` (``state`` + the weights) and ``<tag>[_ema].safetensors`` atomically."""
    from safetensors.torch import save_file
    model_sd = _weights_to_save(model_sd)
    ema_sd = _weights_to_save(ema_sd) if ema_sd is not None else None
    state = dict(state, format=FORMAT, model=model_sd, model_ema=ema_sd)
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    files = [(state_path(folder, tag), lambda p: torch.save(state, p))]
    if ema_sd is not None:
        files.append((weights_path(folder, tag, ema=True), lambda p: save_file(ema_sd, p, metadata=meta)))
    files.append((weights_path(folder, tag), lambda p: save_file(model_sd, p, metadata=meta)))
    for path, write in files:
        write(path + ".tmp")
        _fsync_file(path + ".tmp")
    epoch = int(state.get("epoch", -1))
    _test_pause(epoch, "written", folder)
    for i, (path, _) in enumerate(files):
        os.replace(path + ".tmp", path)
        if i == 0:
            _test_pause(epoch, "renamed", folder)
    fsync_dir(folder)


def copy_checkpoint(folder: str, src_tag: str, dst_tag: str) -> None:
    """Copy one tag's files to another (e.g. last -> best), with the same temp-file + rename order."""
    names = [(state_path(folder, src_tag), state_path(folder, dst_tag))]
    if os.path.exists(weights_path(folder, src_tag, ema=True)):
        names.append((weights_path(folder, src_tag, ema=True), weights_path(folder, dst_tag, ema=True)))
    names.append((weights_path(folder, src_tag), weights_path(folder, dst_tag)))
    for src, dst in names:
        shutil.copyfile(src, dst + ".tmp")
        _fsync_file(dst + ".tmp")
    for src, dst in names:
        os.replace(dst + ".tmp", dst)
    fsync_dir(folder)


def resolve_resume(path: str) -> str:
    """``--resume`` may name the experiment folder, a ``*.state.pt`` file or its ``.safetensors`` sibling."""
    if os.path.isdir(path):
        path = state_path(path, "last")
    elif path.endswith(".safetensors"):
        path = path[: -len(".safetensors")].removesuffix("_ema") + ".state.pt"
    if not os.path.isfile(path):
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
                      f"MiB (last + best + temporary copies while saving), {free / 2**20:.1f} MiB are free. Free "
                      f"some space or choose another --output.")
