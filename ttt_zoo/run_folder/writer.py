"""The one writer of a run folder: ``ttt-zoo train`` creates it (or starts a run that committed nothing again), holds
its lock while it runs, writes its arguments and commits its epochs (see :mod:`ttt_zoo.run_folder`).  Nothing else
writes into a run folder (:func:`~ttt_zoo.run_folder.layout.refuse_run_output`)."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Any, Dict, Optional

from ttt_zoo.fileio import LOCK_NAME, atomic_write, folder_lock

from . import commit
from .layout import ARGS, LOG
from .record import resolve_resume

__all__ = ["RunWriter", "check_restartable"]


def check_restartable(folder: str) -> None:
    """An existing ``--experiment`` folder is started again only when it holds a run that committed nothing (a run
    killed before its first epoch): nothing in it can be lost. Anything else is refused, saying what it holds."""
    if not os.path.isdir(folder):
        raise ValueError(f"--experiment: {folder} exists and is not a folder; give a fresh --experiment NAME (or "
                         f"another --output).")
    epoch = commit.committed_epoch(folder)
    if epoch is not None:
        what = f"epoch {epoch}" if epoch else "a checkpoint"
        raise ValueError(f"Experiment folder {folder} already exists and holds a run ({what} committed); nothing was "
                         f"changed in it. To continue that run use --resume {folder}; to start a new one give a "
                         f"fresh --experiment NAME (or another --output).")
    other = sorted(n for n in os.listdir(folder) if n not in (ARGS, LOG, LOCK_NAME) and not commit.is_stale_temp(n))
    if other:
        raise ValueError(f"Experiment folder {folder} already exists and holds files that are not a ttt-zoo run's "
                         f"({', '.join(other[:5])}); nothing was changed in it. Give a fresh --experiment NAME (or "
                         f"another --output).")


class RunWriter:
    """Rank 0's hold on its run folder: the lock (until :meth:`close`), and whether this run created the folder
    (then a start that fails before its first commit removes it again, so the same command works)."""

    def __init__(self):
        self.folder: Optional[str] = None
        self.created = False
        self._locks = contextlib.ExitStack()

    def _lock(self, folder: str) -> None:
        """One writer per run folder: a second run on it (e.g. another --resume) is refused, naming our PID."""
        try:
            self._locks.enter_context(folder_lock(folder, "ttt-zoo train"))
        except OSError as e:
            raise OSError(f"Output folder {folder!r} is not writable ({e.strerror or e}): its lock file cannot be "
                          f"created. Choose another --output, or fix its permissions / mount.") from e

    def create(self, folder: str, output: str) -> None:
        """A new run in ``folder`` (under ``--output``), or a run that committed nothing started again in place."""
        self.folder = folder
        if os.path.exists(folder):
            check_restartable(folder)
            self._lock(folder)
            check_restartable(folder)  # again, with the lock held
            commit.remove_stale_temps(folder)
            return
        try:
            os.makedirs(folder)
        except OSError as e:
            raise OSError(f"Cannot create the experiment folder {folder} ({e.strerror or e}): --output {output!r} is "
                          f"not writable; choose another --output") from e
        self.created = True
        self._lock(folder)

    def reopen(self, resume: str) -> Optional[str]:
        """The run of ``--resume PATH``, locked, its cut-off commit finished or discarded; the state file to resume
        (None: the run committed nothing and starts again from its args.yaml)."""
        self.folder, _ = resolve_resume(resume)
        self._lock(self.folder)
        commit.recover(self.folder)
        return resolve_resume(resume)[1]  # again, now that no other run can commit

    def write_args(self, name: str, args: Dict[str, Any]) -> None:
        import yaml
        atomic_write(os.path.join(self.folder, name), yaml.safe_dump(args, sort_keys=False))

    def commit(self, *args, **kwargs) -> None:
        """:func:`~ttt_zoo.run_folder.commit.commit_epoch` into this folder."""
        commit.commit_epoch(self.folder, *args, **kwargs)

    def remove_failed_start(self, log: Optional[logging.Logger] = None) -> None:
        """A run that created its folder and failed before its first commit removes the folder."""
        if not self.created or not self.folder or not os.path.isdir(self.folder):
            return
        if commit.committed_epoch(self.folder) is not None:
            return
        for h in list(getattr(log, "handlers", [])):  # (the log file is inside)
            if isinstance(h, logging.FileHandler):
                log.removeHandler(h)
                h.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def close(self) -> None:
        self._locks.close()
