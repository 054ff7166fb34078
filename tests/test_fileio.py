"""The one atomic writer of :mod:`ttt_zoo.fileio`: all or nothing, no temp files left, the normal file mode."""
import os

import pytest

from ttt_zoo.fileio import atomic_path, atomic_write


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")

    def half_then_fail(f):
        f.write("new, partly")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        atomic_write(str(path), half_then_fail)
    with pytest.raises(RuntimeError, match="path writer failed"):
        with atomic_path(str(path)) as tmp:
            open(tmp, "w").write("new, partly")
            raise RuntimeError("path writer failed")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]


def test_written_files_get_the_normal_mode(tmp_path, umask_022):
    atomic_write(str(tmp_path / "a.txt"), "text")
    atomic_write(str(tmp_path / "b.bin"), b"\0\1", binary=True)
    atomic_write(str(tmp_path / "c.bin"), lambda f: f.write(b"x"), binary=True)
    with atomic_path(str(tmp_path / "sub" / "d.pt")) as tmp:  # the folder is created
        assert os.path.dirname(tmp) == str(tmp_path / "sub") and tmp.endswith(".pt")
        open(tmp, "wb").write(b"y")
    assert (tmp_path / "a.txt").read_text() == "text" and (tmp_path / "b.bin").read_bytes() == b"\0\1"
    assert (tmp_path / "c.bin").read_bytes() == b"x" and (tmp_path / "sub" / "d.pt").read_bytes() == b"y"
    for p in ("a.txt", "b.bin", "c.bin", "sub/d.pt"):
        assert (tmp_path / p).stat().st_mode & 0o777 == 0o644, p
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.bin", "c.bin", "sub"]
    assert os.listdir(tmp_path / "sub") == ["d.pt"]


def test_replaces_an_existing_file(tmp_path):
    path = tmp_path / "out.csv"
    path.write_text("old")
    atomic_write(str(path), "a,b\n1,2\n")
    assert path.read_text() == "a,b\n1,2\n"


def test_safetensors_through_atomic_path_get_the_normal_mode(tmp_path, umask_022):
    """safetensors' ``save_file`` creates its file private (0600); weights we publish must be readable (0644)."""
    import torch
    from safetensors.torch import load_file, save_file
    path = tmp_path / "model.safetensors"
    with atomic_path(str(path)) as tmp:
        save_file({"w": torch.ones(2)}, tmp)
    assert path.stat().st_mode & 0o777 == 0o644
    assert torch.equal(load_file(str(path))["w"], torch.ones(2))


def test_lock_names_and_live_locks(tmp_path):
    """A lock file is a holder's, not content: `live_locks` lists those a live process holds."""
    from ttt_zoo.fileio import LOCK_NAME, folder_lock, is_lock_name, live_locks
    assert is_lock_name(LOCK_NAME) and is_lock_name(".out.lock")
    assert not is_lock_name("out.lock") and not is_lock_name("model.safetensors")
    (tmp_path / ".old.lock").write_text("1\n")  # its holder is gone: not live
    assert live_locks(str(tmp_path)) == []
    with folder_lock(str(tmp_path), "test"):
        assert live_locks(str(tmp_path)) == [str(tmp_path / LOCK_NAME)]
    assert live_locks(str(tmp_path)) == [] and live_locks(str(tmp_path / "missing")) == []


def test_remove_dead_temps_only_of_dead_writers_of_that_target(tmp_path):
    import subprocess
    import sys
    from ttt_zoo.fileio import remove_dead_temps
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    names = [f".tmp-a-b-{p.pid}-0123abcd.csv",  # a dead writer of a-b.csv: removed
             f".tmp-a-b-{os.getpid()}-0123abcd.csv",  # ours (alive)
             f".tmp-a-b-{p.pid}-0123abcd.json",  # another target
             f".tmp-a-b-{p.pid}-xyz.csv"]  # not our name pattern
    for n in names:
        (tmp_path / n).write_text("part")
    assert remove_dead_temps(str(tmp_path / "a-b.csv")) == [str(tmp_path / names[0])]
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
    assert remove_dead_temps(str(tmp_path / "missing" / "x.csv")) == []
