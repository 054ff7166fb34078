"""Writing an output folder without ever losing the old one: the new files go into a temporary folder beside the
target, which replaces it only when complete (an atomic exchange on Linux).  A symlink given as the output keeps
pointing where it did: its target is the folder that is replaced.  Used by ``ttt-zoo convert`` (Hub folders and
SD3.5-T5 folders)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from ttt_zoo.errors import HubFolderError
from ttt_zoo.fileio import (NORMAL_DIR_MODE, NORMAL_MODE, is_lock_name, live_locks, named_os_error, note_published,
                            pid_alive)

__all__ = ["output_folder", "check_output", "staged_folder"]


def output_folder(out_dir: str) -> str:
    """The folder that is written for ``out_dir``: itself, or where it points if it is a symlink (the link stays)."""
    out_dir = os.path.abspath(out_dir)
    return os.path.realpath(out_dir) if os.path.islink(out_dir) else out_dir


def check_output(out_dir: str, overwrite: bool = False, flag: str = "--out") -> str:
    """Refuse an output folder that cannot be written, before any work: a run folder or a folder inside one
    (whatever ``overwrite`` says: only ``ttt-zoo train`` writes there), a folder a live process holds a lock in,
    a file, a non-empty folder without ``overwrite``, a read-only folder, a parent that cannot be created.
    Returns the folder that is written (a symlink's target)."""
    from ttt_zoo.run_folder import refuse_run_output
    refuse_run_output(out_dir, flag)
    out_dir = output_folder(out_dir)
    _refuse_live_lock(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise HubFolderError(f"The output path {out_dir} is a file; give a folder path (it is created if needed).")
    if os.path.isdir(out_dir):
        if os.listdir(out_dir) and not overwrite:
            raise HubFolderError(f"{out_dir} exists and is not empty; pass --force to replace it.")
        if not os.access(out_dir, os.W_OK):
            raise HubFolderError(f"{out_dir} is read-only; make it writable or choose another output folder.")
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise HubFolderError(f"Cannot write the output folder {out_dir}: {e.strerror} ({parent}). Choose an "
                             f"output folder you can write to.") from e
    return out_dir


def _refuse_live_lock(out_dir: str) -> None:
    """A folder some live process holds a lock in (a writer at work) is never replaced."""
    held = live_locks(out_dir) if os.path.isdir(out_dir) else []
    if held:
        raise HubFolderError(f"{out_dir} is in use: a running process holds its lock {held[0]}; it is not replaced "
                             f"while that runs. Wait for it to finish, or choose another output folder.")


def _normal_modes(folder: str) -> None:
    """Give every file and folder written into ``folder`` the process's normal mode (safetensors' ``save_file``
    creates its file private, 0600)."""
    for here, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(here, d), NORMAL_DIR_MODE)
        for f in files:
            if not os.path.islink(os.path.join(here, f)):
                os.chmod(os.path.join(here, f), NORMAL_MODE)


def _partial_dir(out_dir: str, overwrite: bool) -> str:
    """Check ``out_dir`` before any work and create the temporary folder beside it that the new files go into."""
    check_output(out_dir, overwrite)
    parent, base = os.path.split(out_dir)
    prefix = f".{base}.partial-"
    for stale in os.listdir(parent):  # left by a killed convert
        pid = stale[len(prefix):].split("-")[0]
        if stale.startswith(prefix) and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    try:
        tmp = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
    except OSError as e:
        raise HubFolderError(f"Cannot write the output folder {out_dir}: {e.strerror} ({parent}). Choose an "
                             f"output folder you can write to.") from e
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    return fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0  # AT_FDCWD, RENAME_EXCHANGE


def _swap_in(tmp: str, out_dir: str) -> None:
    """Replace ``out_dir`` by the complete folder ``tmp``: a kill at any point leaves a complete folder (old or new).

    Files of the old folder that conversion does not write (e.g. a .gitattributes) are kept; lock files never
    (a lock is its holder's, not content), and a folder a live process holds a lock in is not replaced."""
    _normal_modes(tmp)
    if not os.path.isdir(out_dir):
        os.rename(tmp, out_dir)
        note_published(out_dir)
        return
    _refuse_live_lock(out_dir)  # again: a writer may have started since check_output
    for f in os.listdir(out_dir):
        if not os.path.exists(os.path.join(tmp, f)) and not is_lock_name(f):
            src = os.path.join(out_dir, f)
            (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(tmp, f))
    if _exchange(tmp, out_dir):
        shutil.rmtree(tmp)  # tmp now holds the old folder
    else:
        old = tmp + ".old"  # two renames: in between, out_dir is briefly absent but both folders are complete
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old)
    note_published(out_dir)


@contextlib.contextmanager
def staged_folder(out_dir: str, overwrite: bool = False) -> Iterator[str]:
    """Yield an empty temporary folder beside ``out_dir`` (or beside a symlink's target); when the body completes it
    replaces that folder, when it raises it is removed and the old folder is left as it was.  ``out_dir`` is checked
    first: a file, or a non-empty folder without ``overwrite``, is refused."""
    target = output_folder(out_dir)
    tmp = _partial_dir(target, overwrite)
    try:
        yield tmp
        _swap_in(tmp, target)
    except OSError as e:  # e.g. a full disk inside save_file, which names no file: name the folder being written
        if e.filename is None:
            raise named_os_error(e, out_dir) from e
        raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
