"""Readers of a run folder (validate, sample, predict) load what its commit manifest names, never a stale file.

One tiny run (the setup of test_epoch_commit: best epochs 1 and 3) is SIGKILLed in the commit of epoch 3 right after
its manifest landed: checkpoint.json says epoch 3 is best, best.safetensors still holds epoch 1, and the committed
files wait as ``*.tmp``.  Each test works on a copy of that folder."""
import os
import shutil

import pytest

import torch
from safetensors.torch import load_file

from _train_data import make_tiny_digits
from test_cli_errors import cli
from test_epoch_commit import _finish, _kill_when_paused, _start

from ttt_zoo.checkpoint import CheckpointError
from ttt_zoo.run_folder import find_weights
from ttt_zoo.fileio import folder_lock, sha256_file
from ttt_zoo.train import run_state as ckpt
from ttt_zoo.train import validate as validate_mod

WEIGHTS = ("last.safetensors", "last_ema.safetensors", "best.safetensors", "best_ema.safetensors")


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    root = tmp_path_factory.mktemp("readers")
    data = make_tiny_digits(str(root / "digits"))
    folder = root / "runs" / "k"
    _kill_when_paused(_start(data, root / "runs", "k", pause="3:committed"), folder, "committed")
    manifest = ckpt.read_manifest(str(folder))
    assert (manifest["epoch"], manifest["best_epoch"]) == (3, 2), "epoch 3 must be best (see test_epoch_commit)"
    for name in WEIGHTS:  # the situation under test: stale public files, the committed ones pending
        assert sha256_file(str(folder / name)) != manifest["files"][name], name
        assert sha256_file(str(folder / (name + ckpt.TMP))) == manifest["files"][name], name
    committed = {n: load_file(str(folder / (n + ckpt.TMP))) for n in WEIGHTS}
    stale = load_file(str(folder / "best.safetensors"))  # epoch 1's: other tensors, so a wrong load is caught
    assert any(not torch.equal(stale[k], v) for k, v in committed["best.safetensors"].items())
    return {"folder": folder, "manifest": manifest, "committed": committed, "data": data, "root": root}


@pytest.fixture
def run(killed, tmp_path):
    """A fresh copy of the killed run folder."""
    folder = tmp_path / "k"
    shutil.copytree(killed["folder"], folder)
    return folder


def _assert_consistent(folder, manifest):
    """recover() ran: no pending temps, every committed file is the committed bytes."""
    assert not [n for n in os.listdir(folder) if n.endswith(ckpt.TMP)]
    for name, digest in manifest["files"].items():
        assert sha256_file(str(folder / name)) == digest, name


def _assert_same_tensors(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def test_committed_weights_publishes_the_manifest_best(killed, run):
    path = ckpt.committed_weights(str(run), "best")
    assert path == str(run / "best.safetensors")
    assert sha256_file(path) == killed["manifest"]["files"]["best.safetensors"]
    _assert_consistent(run, killed["manifest"])
    _assert_same_tensors(load_file(path), killed["committed"]["best.safetensors"])
    assert ckpt.committed_weights(str(run), "last", ema=True) == str(run / "last_ema.safetensors")


def test_validate_cli_loads_the_epoch_the_manifest_calls_best(killed, run, capsys, monkeypatch):
    loaded = {}
    real = validate_mod.load_weights

    def recording(model, path, use_ema=False):
        real(model, path, use_ema)
        loaded[os.path.basename(path)] = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(validate_mod, "load_weights", recording)
    rc, err = cli(capsys, "validate", "--checkpoint", run, "--workers", 0, "--device", "cpu")
    assert rc == 0, err
    assert set(loaded) == {"last.safetensors", "best.safetensors"}
    for name, sd in loaded.items():  # bit for bit the committed weights, not the stale epoch-1 / epoch-2 files
        _assert_same_tensors(sd, killed["committed"][name])
    _assert_consistent(run, killed["manifest"])


def test_find_weights_sample_and_predict_take_the_committed_ema(killed, run):
    path = find_weights(str(run))
    assert path == str(run / "best_ema.safetensors")
    _assert_same_tensors(load_file(path), killed["committed"]["best_ema.safetensors"])
    _assert_consistent(run, killed["manifest"])


def test_live_run_holding_the_lock_gives_a_retry_error(killed, run):
    with folder_lock(str(run), "ttt-zoo train"):  # what a live run, publishing right now, holds
        with pytest.raises(CheckpointError, match="committing epoch 3 right now.*retry in a moment"):
            ckpt.committed_weights(str(run), "best")
    assert (run / "best.safetensors.tmp").exists()  # nothing was touched
    assert ckpt.committed_weights(str(run), "best") == str(run / "best.safetensors")


def test_corrupted_committed_file_is_a_one_line_error(killed, run, capsys):
    ckpt.recover(str(run))
    data = bytearray((run / "best.safetensors").read_bytes())
    data[-1] ^= 1
    (run / "best.safetensors").write_bytes(bytes(data))
    rc, err = cli(capsys, "validate", "--checkpoint", run / "best.safetensors", "--workers", 0, "--device", "cpu")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "best.safetensors" in lines[0], err
    assert "corrupted or changed" in lines[0]


def test_neither_public_nor_pending_file_matches(killed, run):
    data = bytearray((run / "best.safetensors.tmp").read_bytes())
    data[-1] ^= 1
    (run / "best.safetensors.tmp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="best.safetensors is missing or differs.*corrupted or changed"):
        ckpt.committed_weights(str(run), "best")
    assert (run / "best.safetensors.tmp").exists()  # nothing was published


def test_deleted_manifest_is_an_error_naming_it(killed, run, capsys):
    ckpt.recover(str(run))
    os.remove(run / ckpt.MANIFEST)  # run.json is there: epochs were committed, so the checks cannot be turned off
    with pytest.raises(CheckpointError, match=r"checkpoint.json is missing, but .*run.json shows"):
        ckpt.committed_weights(str(run), "best")
    rc, err = cli(capsys, "validate", "--checkpoint", run, "--workers", 0, "--device", "cpu")
    assert rc == 2 and err.strip().splitlines() == [err.strip()] and "checkpoint.json is missing" in err, err


def test_folder_without_manifest_loads_as_before(killed, run, capsys):
    ckpt.recover(str(run))
    os.remove(run / ckpt.MANIFEST)  # a run from before manifests had neither file
    os.remove(run / "run.json")
    assert ckpt.committed_weights(str(run), "best") == str(run / "best.safetensors")
    assert find_weights(str(run)) == str(run / "best_ema.safetensors")
    rc, err = cli(capsys, "validate", "--checkpoint", run, "--workers", 0, "--device", "cpu")
    assert rc == 0, err
