"""File helpers shared by every writer of the package (the first piece of one I/O module, issue 28)."""
import os

__all__ = ["fsync_dir"]


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
