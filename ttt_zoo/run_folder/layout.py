"""The run folder's file names and where a run folder is (see :mod:`ttt_zoo.run_folder`)."""
from __future__ import annotations

import os
import re
from typing import List, Optional

__all__ = ["ARGS", "RECORD", "RECORD_FORMAT", "SUMMARY", "MANIFEST", "MANIFEST_FORMAT", "LOG", "PLOT", "TAGS", "TMP",
           "STATE_SUFFIX", "EMA_WEIGHTS_SUFFIX", "RUN_WEIGHTS", "state_name", "weights_name", "state_path",
           "weights_path", "manifest_path", "resume_args_name", "resume_args_names", "commit_names", "family",
           "state_file_of", "ema_weights_of", "tag_of", "is_run_folder", "enclosing_run", "refuse_run_output"]

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



def resume_args_names(folder: str) -> List[str]:
    """The folder's ``args.resume-epoch<N>.yaml`` files in epoch order."""
    found = sorted((int(m.group(1)), n) for n in os.listdir(folder) if (m := _RESUME_ARGS_RE.fullmatch(n)))
    return [n for _, n in found]
