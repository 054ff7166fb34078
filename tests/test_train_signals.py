"""Ctrl-C (SIGINT) and SIGTERM stop `ttt-zoo train` between two steps with one line, exit 130 / 143.

Each run is a real `ttt-zoo train` process (tests/_commit_faults.py holds it at a known point: the end of its setup,
or inside its first commit); the signal is sent there, then the run is let go on."""
import os
import signal
import subprocess
import time

import pytest

import _commit_faults
from _train_data import make_tiny_digits

from ttt_zoo import run_folder
from ttt_zoo.fileio import LOCK_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
TINY = ["--model", "vit3_tiny", "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4",
        "--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0",
        "--val-split", "val", "--log-interval", "100", "-b", "16", "--epochs", "20"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_digits(str(tmp_path_factory.mktemp("digits")))  # 40 train images: 2 steps at -b 16 (drop_last)


def _signal_at(data, out, pause, sig):
    """Run `ttt-zoo train` held at ``pause``, send ``sig`` there, let it go on; (exit status, stderr lines)."""
    folder = out / "k"
    stage = pause.split(":", 1)[1]
    cmd = _commit_faults.command(pause, "train", "--data-dir", data, "--output", str(out), "--experiment", "k",
                                 *TINY)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = folder / _commit_faults.MARKER
    try:
        while not (marker.exists() and marker.read_text() == stage):  # a hang is caught by pytest-timeout
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.05)
        proc.send_signal(sig)
        time.sleep(0.2)  # (the handler has run: the process only sleeps at the marker)
        os.remove(marker)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err.strip().splitlines(), folder


def _assert_clean_stop(lines, folder):
    assert not any("Traceback" in line for line in lines), "\n".join(lines[-20:])
    assert lines[-1].startswith("ttt-zoo train: stopped by ")
    names = os.listdir(folder)
    assert not [n for n in names if run_folder.is_stale_temp(n)] and LOCK_NAME not in names  # nothing half-done


def test_ctrl_c_inside_a_commit_lets_it_complete_then_stops_with_one_line(data, tmp_path):
    rc, lines, folder = _signal_at(data, tmp_path, "1:written", signal.SIGINT)
    assert rc == 130, "\n".join(lines[-20:])
    _assert_clean_stop(lines, folder)
    manifest = run_folder.read_manifest(str(folder))
    assert manifest["epoch"] == 1  # the commit that was under way when Ctrl-C came completed
    assert lines[-1] == (f"ttt-zoo train: stopped by SIGINT after epoch 0; 1 epoch committed: continue with "
                         f"`ttt-zoo train --resume {folder}`")  # (epochs as the log and summary.csv count them)


def test_sigterm_before_the_first_commit_says_nothing_was_committed(data, tmp_path):
    rc, lines, folder = _signal_at(data, tmp_path, "0:setup", signal.SIGTERM)
    assert rc == 143, "\n".join(lines[-20:])
    _assert_clean_stop(lines, folder)
    assert run_folder.read_manifest(str(folder)) is None and os.path.isfile(folder / run_folder.ARGS)
    assert lines[-1] == (f"ttt-zoo train: stopped by SIGTERM in epoch 0 after step 1 of 2; no epoch was "
                         f"committed: start the run again with `ttt-zoo train --resume {folder}`")
