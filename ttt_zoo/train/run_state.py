"""The training state of a run: the RNG streams every rank resumes, the state file's reader, and the checks before
the first epoch (the folder is writable, its disk holds the checkpoints).  Everything else about the run folder
(names, the record, the epoch commit, the one hash check, the resolvers) is :mod:`ttt_zoo.run_folder`; the names
below are re-exported from it for older callers.
"""
from __future__ import annotations

import os
import random
import shutil
from typing import Any, Dict

import numpy as np
import torch

from ttt_zoo.run_folder import (  # noqa: F401  (the names the tests and older callers use, re-exported)
    MANIFEST, MANIFEST_FORMAT, RECORD, STATE_FORMAT, SUMMARY, TAGS, TMP, commit_epoch, commit_names,
    committed_epoch, committed_weights, family, load_state, manifest_path, publish, read_manifest, recover,
    resolve_resume, state_file_of, state_name, state_path, weights_name, weights_path)

__all__ = ["FORMAT", "commit_epoch", "load_state", "resolve_resume", "rng_state", "set_rng_state",
           "check_output_dir", "estimate_checkpoint_bytes"]

FORMAT = STATE_FORMAT
_commit_names = commit_names  # (the tests' name for it)


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
