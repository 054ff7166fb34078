"""One writer per folder (issue 27): the flock helper, a second `train --resume` of a live run, two converts."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from _train_data import make_tiny_digits

from ttt_zoo.fileio import LOCK_NAME, FolderInUseError, folder_lock, lock_file_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
TINY = ["--model", "vit3_tiny", "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4",
        "--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0",
        "--val-split", "val", "--log-interval", "100", "-b", "16"]

# holds the lock of argv[1] (argv[2] == "beside": next to it), says so on stdout, releases at stdin's EOF
_HOLDER = """
import sys
from ttt_zoo.fileio import folder_lock
with folder_lock(sys.argv[1], "test holder", beside=sys.argv[2] == "beside"):
    print("locked", flush=True)
    sys.stdin.read()
"""


def _start_holder(folder, beside=False):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder), "beside" if beside else "inside"],
                            cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"  # blocks until the child holds the lock
    return proc


def _snapshot(folder):
    """Every file's bytes and mtime: what "untouched" means."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            out[name] = (f.read(), os.stat(path).st_mtime_ns)
    return out


# ----- the helper -----

def test_second_holder_is_refused_naming_the_holders_pid(tmp_path):
    proc = _start_holder(tmp_path)
    try:
        with pytest.raises(FolderInUseError, match=rf"{tmp_path} is in use by another test run \(PID {proc.pid}\)"
                                                   rf".*kill {proc.pid}"):
            with folder_lock(str(tmp_path), "test run"):
                pass
        assert open(tmp_path / LOCK_NAME).read() == f"{proc.pid}\n"
    finally:
        proc.stdin.close()  # the holder leaves its `with`
        proc.wait()
    assert proc.returncode == 0
    assert not (tmp_path / LOCK_NAME).exists()  # removed on release
    with folder_lock(str(tmp_path), "test run") as path:  # free again
        assert open(path).read() == f"{os.getpid()}\n"
        with pytest.raises(FolderInUseError, match=f"PID {os.getpid()}"):  # also within one process
            with folder_lock(str(tmp_path), "test run"):
                pass
    assert os.listdir(tmp_path) == []


def test_lock_of_a_killed_holder_is_taken_over(tmp_path):
    proc = _start_holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stdin.close()
    dead = proc.pid
    assert open(tmp_path / LOCK_NAME).read() == f"{dead}\n"  # a stale lock file, whose flock the OS dropped
    with folder_lock(str(tmp_path), "test run") as path:
        assert open(path).read() == f"{os.getpid()}\n"
        # in the instant between a new holder's flock and its PID write, the file still names the dead one:
        # the refusal names the real holder (or none), never the dead PID
        with open(path, "w") as f:
            f.write(f"{dead}\n")
        with pytest.raises(FolderInUseError) as e:
            with folder_lock(str(tmp_path), "test run"):
                pass
        assert f"PID {dead}" not in str(e.value)
        if os.path.exists("/proc/locks"):
            assert f"PID {os.getpid()}" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_lock_beside_a_folder_that_does_not_exist_yet(tmp_path):
    out = tmp_path / "new"
    proc = _start_holder(out, beside=True)
    try:
        assert os.listdir(tmp_path) == [".new.lock"] == [os.path.basename(lock_file_path(str(out), beside=True))]
        with pytest.raises(FolderInUseError, match=f"PID {proc.pid}"):
            with folder_lock(str(out), "test run", beside=True):
                pass
    finally:
        proc.stdin.close()
        proc.wait()
    assert os.listdir(tmp_path) == []  # neither the folder nor the lock file is left


# ----- a second `train --resume` of a live run -----

def test_second_resume_of_a_live_run_is_refused_and_changes_nothing(tmp_path):
    data = make_tiny_digits(str(tmp_path / "digits"))
    out = tmp_path / "runs"
    folder = out / "r"
    train = [sys.executable, "-m", "ttt_zoo", "train", "--data-dir", data, "--output", str(out), *TINY,
             "--epochs", "2"]
    # the first run saves epoch 1 (so there is a state to resume), then holds inside the epoch-2 save
    import _commit_faults
    first = subprocess.Popen(_commit_faults.command("2:written", *train[3:], "--experiment", "r"), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    try:
        marker = folder / _commit_faults.MARKER
        # wait for the marker's content (then the first run only sleeps); a hang is caught by pytest-timeout
        while not (marker.exists() and marker.read_text() == "written"):
            assert first.poll() is None, first.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        before = _snapshot(folder)
        assert {"last.state.pt", "last.state.pt.tmp", "log.txt", LOCK_NAME} <= set(before)
        assert before[LOCK_NAME][0] == f"{first.pid}\n".encode()

        second = subprocess.run(train + ["--resume", str(folder)], cwd=ROOT, env=ENV, capture_output=True,
                                text=True)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), second.stderr[-2000:]
        assert f"{folder} is in use by another ttt-zoo train (PID {first.pid})" in lines[0]
        assert _snapshot(folder) == before  # no byte, name or mtime of the first run changed
        assert first.poll() is None  # and the first run is still there, paused
    finally:
        first.kill()
        first.wait()
        first.stderr.close()
    # the killed run's lock file is left behind; the next --resume takes it over and finishes the run
    os.remove(marker)
    from ttt_zoo.train import run_state as ckpt
    from ttt_zoo.train.trainer import main
    main(["--data-dir", data, "--output", str(out), *TINY, "--epochs", "2", "--resume", str(folder)])
    assert ckpt.load_state(ckpt.state_path(str(folder), "last"))["epoch"] == 2
    assert not (folder / LOCK_NAME).exists()


# ----- two converts to one folder -----

def test_convert_to_a_folder_being_written_is_refused(tmp_path, capsys):
    import timm
    from ttt_zoo.cli import main as cli_main
    args = {"img_size": 32, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}
    src = str(tmp_path / "src.pth")
    torch.save({"model": timm.create_model("vit3_tiny", **args).state_dict()}, src)
    out = tmp_path / "hub" / "vit3_tiny.in1k"
    cmd = ["convert", src, "--model", "vit3_tiny.in1k", "--model-args", json.dumps(args), "--out", str(out),
           "--no-flops"]
    with folder_lock(str(out), "ttt-zoo convert", beside=True):  # the first convert, still writing
        assert cli_main(cmd) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")
        assert f"{out} is in use by another ttt-zoo convert (PID {os.getpid()})" in err[0]
        assert os.listdir(out.parent) == [".vit3_tiny.in1k.lock"]  # nothing written, no partial folder
    assert cli_main(cmd) == 0  # once free, the same command works
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    assert os.listdir(out.parent) == ["vit3_tiny.in1k"]  # the lock file is gone with its holder
