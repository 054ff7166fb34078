"""The package's one I/O module for files: the atomic writer, the sha256 of a file and the one-writer folder lock.

Every file ttt-zoo publishes goes through :func:`atomic_write` (text, bytes, or a callback writing to a file
object) or :func:`atomic_path` (a temporary path for writers that need a name: ``torch.save``, safetensors'
``save_file``, ONNX, ``savefig``): a temp file in the same folder, flushed and fsync'ed, renamed onto the target,
the folder fsync'ed; the normal file mode (0644 under umask 022). Writers that commit several files together (the
epoch commit of :mod:`ttt_zoo.train.run_state`) use the pieces: :func:`write_file`, :func:`fsync_file` and
:func:`replace_file`. Weight files are *read* by :mod:`ttt_zoo.checkpoint` (safetensors / ``weights_only``).
"""
import contextlib
import errno
import fcntl
import hashlib
import os
import re
from typing import IO, Callable, Iterator, List, Optional, Set, Union

from ttt_zoo.errors import FolderInUseError, UsageError  # noqa: F401  (re-exported)

__all__ = ["atomic_write", "atomic_path", "named_os_error", "write_file", "fsync_file", "replace_file", "fsync_dir",
           "sha256_file", "folder_lock", "lock_file_path", "FolderInUseError", "LOCK_NAME", "pid_alive", "NORMAL_MODE",
           "NORMAL_DIR_MODE", "remove_dead_temps", "is_lock_name", "live_locks", "published", "note_published"]

_UMASK = os.umask(0o022)
os.umask(_UMASK)
_NORMAL_MODE = 0o666 & ~_UMASK  # what open() gives a new file: 0644 under umask 022
NORMAL_MODE = _NORMAL_MODE
NORMAL_DIR_MODE = 0o777 & ~_UMASK  # what os.mkdir gives a new folder: 0755 under umask 022

LOCK_NAME = ".ttt-zoo.lock"  # inside a locked folder; beside one: ".<folder name>.lock"


def fsync_dir(folder: str) -> None:
    """Make a rename inside ``folder`` durable; a folder that cannot be opened or synced is left as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----- the atomic writer -----

Data = Union[str, bytes, Callable[[IO], object]]


def fsync_file(path: str) -> None:
    """Flush a written (closed) file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(tmp: str, path: str) -> None:
    """Rename the complete file ``tmp`` onto ``path`` (same folder) and make the rename durable."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_file(path: str, data: Data, binary: bool = False) -> None:
    """Write ``data`` (str, bytes, or a callable given the open file object) to ``path``, flushed and fsync'ed.

    Not atomic on its own: ``path`` is a temp file a caller renames later. The file gets the process's normal
    mode (0644 under umask 022), as for ``open()``."""
    with open(path, "wb" if binary else "w", **({} if binary else dict(newline=""))) as f:
        data(f) if callable(data) else f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _temp_sibling(path: str) -> str:
    """A fresh hidden name beside ``path`` (same folder, so the rename is atomic; same extension, for writers that
    pick the format by it). The writer's PID is in the name: :func:`remove_dead_temps` finds it there."""
    base, ext = os.path.splitext(os.path.basename(path))
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".tmp-{base}-{os.getpid()}-{os.urandom(4).hex()}{ext}")


def remove_dead_temps(path: str) -> List[str]:
    """Remove the temp files that writers of ``path`` left beside it when they were killed (names from
    :func:`_temp_sibling` whose PID is no longer alive); a live writer's temp is kept. Returns the removed paths."""
    folder = os.path.dirname(os.path.abspath(path))
    base, ext = os.path.splitext(os.path.basename(path))
    pattern = re.compile(rf"\.tmp-{re.escape(base)}-(\d+)-[0-9a-f]{{8}}{re.escape(ext)}")
    try:
        names = os.listdir(folder)
    except OSError:  # no folder yet, or not readable: nothing to clean
        return []
    removed = []
    for name in names:
        m = pattern.fullmatch(name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):  # another cleaner was first
                os.unlink(os.path.join(folder, name))
                removed.append(os.path.join(folder, name))
    return removed


_PUBLISHED: List[str] = []  # every path atomic_path (or a staged folder) published in this process, in order


def note_published(path: str) -> None:
    """Record that ``path`` is now complete (a Ctrl-C line says which outputs were kept)."""
    _PUBLISHED.append(os.path.abspath(path))


def published(start: int = 0) -> List[str]:
    """The paths published in this process since the ``start``-th (``len(published())`` marks a start)."""
    return _PUBLISHED[start:]


def named_os_error(e: OSError, path: str) -> OSError:
    """``e`` naming ``path`` when it names no file (``torch.save`` and safetensors' ``save_file`` raise a full disk
    without one), so that its one ``error:`` line says which file could not be written."""
    if e.filename is not None:
        return e
    named = OSError(e.errno, e.strerror or str(e), path)
    named.__cause__ = e
    return named


@contextlib.contextmanager
def atomic_path(path: str, temp: Optional[str] = None) -> Iterator[str]:
    """Yield a temporary path beside ``path`` for a writer that needs a file name; when the body completes, the
    file is fsync'ed and renamed onto ``path`` (and the folder fsync'ed); when it raises, the temp file is removed
    and ``path`` is left as it was. ``temp`` names the temp file instead (a layout that fixes it, e.g. the HF
    cache's ``<blob>.incomplete``); the folder of ``path`` is created. Temps beside ``path`` of writers that were
    killed are removed first (:func:`remove_dead_temps`)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    remove_dead_temps(path)
    tmp = temp or _temp_sibling(path)
    try:
        yield tmp
        os.chmod(tmp, _NORMAL_MODE)  # some writers (safetensors' save_file) create their file private (0600)
        fsync_file(tmp)
        replace_file(tmp, path)
        note_published(path)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:
            raise named_os_error(e, path) from e
        raise


def atomic_write(path: str, data: Data, binary: bool = False) -> None:
    """Replace ``path`` by ``data`` (str, or bytes with ``binary``, or a callable writing to the file object) all
    at once: a reader sees the old file or the new one, never a part; on any error the old file stays."""
    with atomic_path(path) as tmp:
        write_file(tmp, data, binary)


# ----- one writer per folder -----

def lock_file_path(folder: str, beside: bool = False) -> str:
    """The lock file of ``folder``: inside it, or (``beside``) next to it for a folder that is created or swapped
    in by rename. One kind of writer must always use the same place."""
    folder = os.path.abspath(folder)
    if beside:
        parent, name = os.path.split(folder)
        return os.path.join(parent, f".{name}.lock")
    return os.path.join(folder, LOCK_NAME)


_LOCK_NAME_RE = re.compile(r"\..+\.lock")


def is_lock_name(name: str) -> bool:
    """A lock file's name: :data:`LOCK_NAME` inside a folder, ``.<name>.lock`` beside one."""
    return name == LOCK_NAME or bool(_LOCK_NAME_RE.fullmatch(name))


def _lock_is_held(path: str) -> bool:
    """Whether a live process holds the flock of the file ``path``: read from /proc/locks (which changes nothing),
    else probed with a shared lock taken and dropped at once (a holder in another PID namespace shows no PID)."""
    try:
        inode = os.stat(path).st_ino
    except OSError:
        return False
    if _flock_holders(inode):
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:  # no locks on this file system
        return False
    finally:
        os.close(fd)


def live_locks(folder: str) -> List[str]:
    """The lock files directly inside ``folder`` that a live process holds (e.g. a running ``ttt-zoo train``)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if is_lock_name(n) and _lock_is_held(os.path.join(folder, n))]


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def pid_alive(pid: int) -> bool:
    """A process with this PID exists (possibly another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _flock_holders(inode: int) -> Optional[Set[int]]:
    """PIDs holding a flock on ``inode`` per /proc/locks (Linux); None where that file cannot be read."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK":  # "1: FLOCK ADVISORY WRITE <pid> <maj:min:inode> ..."
            pid, where = parts[4], parts[5]
            if pid.isdigit() and int(pid) > 0 and where.rsplit(":", 1)[-1] == str(inode):
                pids.add(int(pid))
    return pids


def _holder_pid(fd: int) -> Optional[int]:
    """The PID written in the lock file, if that process really holds the lock; never a dead one (the file may
    still name a killed holder for the instant between a new holder's flock and its write)."""
    try:
        written: Optional[int] = int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        written = None
    holders = _flock_holders(os.fstat(fd).st_ino)
    if holders is None:
        return written if written is not None and pid_alive(written) else None
    if written in holders:
        return written
    return next(iter(holders)) if len(holders) == 1 else None


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _acquire(folder: str, path: str, what: str) -> Optional[int]:
    """An fd holding ``LOCK_EX`` on ``path`` with our PID written in it; None where the file system has no flock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder_pid(fd)
            os.close(fd)
            who = f"PID {pid}" if pid is not None else "a process that has not written its PID yet"
            stop = f"wait for PID {pid} to finish or stop it (`kill {pid}`)" if pid is not None else "wait for it"
            raise FolderInUseError(f"{folder} is in use by another {what} ({who}); only one may write it at a "
                                   f"time: {stop}, then run this again") from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # no locks here: run unguarded
                return None
            raise
        # the previous holder unlinks the file on release: if it did after our open, lock the new file instead
        if _same_file(fd, path):
            break
        os.close(fd)
    # a file left by a killed holder (the OS dropped its lock) is simply taken over: replace its PID by ours
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def folder_lock(folder: str, what: str, beside: bool = False) -> Iterator[str]:
    """Hold an exclusive advisory lock (``fcntl.flock``) on ``folder`` for the ``with`` body.

    The lock file is inside ``folder`` (which must exist), or with ``beside`` next to it (its parent is created).
    A second holder, in any process, gets :class:`FolderInUseError` naming the holder's PID; a lock whose holder
    died is released by the OS and taken over. ``what`` names the kind of writer ("training run").
    OSErrors creating the lock file propagate (the caller words them)."""
    path = lock_file_path(folder, beside)
    if beside:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = _acquire(os.path.abspath(folder), path, what)
    try:
        yield path
    finally:
        if fd is not None:
            if _same_file(fd, path):  # unlink while still locked (see _acquire), so no lock file is left behind
                with contextlib.suppress(OSError):
                    os.unlink(path)
            os.close(fd)
