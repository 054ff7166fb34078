"""An epoch's checkpoint set (last.*, best.*, summary.csv) commits atomically through checkpoint.json.

A real SIGKILL at every write point of the commit, and at 20 seeded random moments, then ``--resume`` to the end,
gives the uninterrupted run's files bit for bit.  Runs are children forked from a forkserver (one thread each, so
every run computes the same bits; no interpreter start per run), killed with SIGKILL while the fault injection of
``tests/_commit_faults.py`` holds them at a stage of a commit, or at a random moment while they train or wait at
the end.
"""
import csv
import json
import multiprocessing
import os
import random
import shutil
import signal
import time

import pytest

from ttt_zoo.fileio import sha256_file
import torch

import _commit_faults
from _train_data import make_tiny_digits

from ttt_zoo import run_folder
from ttt_zoo.checkpoint import CheckpointError
from ttt_zoo.fileio import LOCK_NAME
from ttt_zoo.train import run_state as ckpt

EPOCHS = 3
TINY = ["--model", "vit3_tiny", "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4",
        "--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.5", "--warmup-epochs", "0",
        "--val-split", "val", "--log-interval", "100", "-b", "16", "--epochs", str(EPOCHS),
        "--model-ema", "--model-ema-decay", "0.5"]
TIMING_COLUMNS = ("train_img_per_sec", "epoch_time")  # wall-clock measurements: present, never compared
COMMITTED = ("last.state.pt", "last_ema.safetensors", "last.safetensors", "best.state.pt", "best_ema.safetensors",
             "best.safetensors", "run.json", "summary.csv")


# ----- runs as child processes -----

# Forked from a forkserver that imported torch and the trainer once (``_commit_faults.train_child``): a fresh
# interpreter per run cost seconds each (dozens of runs), and a fork of this process cannot run autograd once its
# autograd engine has started its threads (an earlier test in the same pytest worker may have: "Unable to handle
# autograd's threading in combination with fork-based multiprocessing"); the forkserver never runs autograd.
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["_commit_faults", "torch", "ttt_zoo.train.trainer"])


def _start(data, out, experiment=None, resume=None, pause=None, hold=False):
    """Start a child running ``ttt-zoo train`` (a fresh run, or ``--resume``); ``pause`` = "<epoch>:<stage>" for the
    fault injection (tests/_commit_faults.py); ``hold``: after finishing, the child waits to be killed (so a kill
    always lands on a live one). Returns the process; its exit code is the trainer's (143 after a SIGTERM); its
    output goes to a ``child-*.log`` file in OUT, beside the run folder."""
    argv = ["--data-dir", data, "--output", str(out), *TINY]
    argv += ["--resume", str(resume)] if resume else ["--experiment", experiment]
    os.makedirs(out, exist_ok=True)
    log = os.path.join(str(out), f"child-{time.monotonic_ns()}.log")
    proc = _CTX.Process(target=_commit_faults.train_child, args=(argv, pause, hold, log))
    proc.start()
    proc.log = log
    return proc


def _log_tail(proc, n=3000):
    try:
        with open(proc.log, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"(no log: {e})"


def _finish(proc):
    proc.join()
    assert proc.exitcode == 0, f"the training child failed (exit {proc.exitcode}):\n{_log_tail(proc)}"


def _kill(proc):
    proc.kill()  # SIGKILL
    proc.join()
    assert proc.exitcode == -signal.SIGKILL  # a real kill of a live process


def _start_and_sleep(proc, seconds):
    """``proc`` after ``seconds``: the random moment of a kill (it only decides where the kill lands)."""
    time.sleep(seconds)
    return proc


def _kill_when_paused(proc, folder, stage):
    """SIGKILL the child once the hook holds it at ``stage`` (it then only sleeps)."""
    marker = folder / _commit_faults.MARKER
    while not (marker.exists() and marker.read_text() == stage):  # a hang is caught by pytest-timeout
        assert proc.is_alive(), f"the child ended (exit {proc.exitcode}) before reaching {stage!r}:\n{_log_tail(proc)}"
        time.sleep(0.02)
    _kill(proc)
    os.remove(marker)


# ----- what a finished run folder holds -----

def _rows(folder):
    with open(folder / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        assert all(float(r[c]) > 0 for c in TIMING_COLUMNS)
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in rows]


def _state_fields(folder, tag):
    s = ckpt.load_state(ckpt.state_path(str(folder), tag))
    tensors = {f"{part}.{k}": v for part in ("model", "model_ema") for k, v in s[part].items()}
    tensors.update({f"opt.{i}.{k}": v for i, st in s["optimizer"]["state"].items() for k, v in st.items()})
    return {k: s[k] for k in ("epoch", "num_updates", "metric", "best_metric", "best_epoch")}, tensors


def _safetensors_content(path):
    """The header (tensor names, dtypes, shapes, offsets, metadata) as a dict and the data section's bytes: the
    header's JSON key order differs between processes (safetensors serializes a hash map), nothing else may."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _fingerprint(folder):
    """Everything a finished run must agree on bit for bit (timings and the invocation's own args aside)."""
    names = set(os.listdir(folder))
    leftovers = sorted(n for n in names if run_folder.is_stale_temp(n) or n in (LOCK_NAME, _commit_faults.MARKER))
    assert not leftovers, leftovers  # no temp of a dead writer, no lock of a finished run
    manifest = ckpt.read_manifest(str(folder))
    assert manifest is not None and set(manifest["files"]) == set(COMMITTED)
    for name, digest in manifest["files"].items():  # the manifest names exactly what is on disk
        assert sha256_file(str(folder / name)) == digest, name
    out = {"manifest": (manifest["epoch"], manifest["best_epoch"]), "summary": _rows(folder)}
    for name in ("last.safetensors", "last_ema.safetensors", "best.safetensors", "best_ema.safetensors"):
        out[name] = _safetensors_content(folder / name)
    for tag in ckpt.TAGS:
        fields, tensors = _state_fields(folder, tag)
        out[tag + ".state"] = fields
        out[tag + ".tensors"] = {k: (v.dtype, v.shape, v.numpy().tobytes()) for k, v in tensors.items()}
    return out


def _assert_same(folder, reference):
    got = _fingerprint(folder)
    assert got.keys() == reference.keys()
    for k in reference:
        assert got[k] == reference[k], k


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The uninterrupted reference run: data, fingerprint, wall time, and which epochs (1-based) became best."""
    root = tmp_path_factory.mktemp("commit")
    data = make_tiny_digits(str(root / "digits"))
    t0 = time.perf_counter()
    _finish(_start(data, root / "runs", "ref"))
    seconds = time.perf_counter() - t0
    folder = root / "runs" / "ref"
    fp = _fingerprint(folder)
    best, bests = None, []
    for r in fp["summary"]:
        top1 = float(r["eval_top1"])
        if best is None or top1 > best:
            best = top1
            bests.append(int(r["epoch"]) + 1)
    assert fp["manifest"] == (EPOCHS, bests[-1] - 1) and len(fp["summary"]) == EPOCHS
    return {"data": data, "fp": fp, "seconds": seconds, "best_epochs": bests, "root": root}


def _stages(best):
    names = [n for n in COMMITTED if best or not n.startswith("best")]
    return ([f"wrote:{n}" for n in names] + ["written", "committed"] + [f"renamed:{n}" for n in names] +
            ["published"])


def _kill_at_then_resume(ref, tmp_path, epoch, stage):
    folder = tmp_path / "k"
    _kill_when_paused(_start(ref["data"], tmp_path, "k", pause=f"{epoch}:{stage}"), folder, stage)
    manifest = ckpt.read_manifest(str(folder))
    before_commit = stage.startswith("wrote:") or stage == "written"
    committed_epoch = epoch - 1 if before_commit else epoch
    if committed_epoch == 0:  # nothing committed yet: the same command starts the run again in its folder
        assert manifest is None and not (folder / "last.state.pt").exists()
        _finish(_start(ref["data"], tmp_path, "k"))
    else:
        assert manifest["epoch"] == committed_epoch
        _finish(_start(ref["data"], tmp_path, resume=folder))
    _assert_same(folder, ref["fp"])


@pytest.mark.parametrize("which", ["best", "not_best", "first"])
def test_sigkill_at_every_commit_stage_then_resume_equals_reference(ref, tmp_path, which):
    """Every stage of the commit of the last epoch that became best (not the first: best.* are replaced), of an
    epoch that is not best, and the two edges of the first commit (nothing committed before it)."""
    bests = ref["best_epochs"]
    later, not_best = [e for e in bests if e > 1], [e for e in range(2, EPOCHS + 1) if e not in bests]
    # --lr 0.5 makes epochs 1 and 3 best and 2 not (eval_top1 10, 10, 15): both kinds of commit are covered
    assert later and not_best, f"best epochs {bests}: change --lr so that both kinds of epoch occur"
    if which == "best":
        epoch, stages = later[-1], _stages(best=True)
    elif which == "not_best":
        epoch, stages = not_best[-1], _stages(best=False)
    else:
        epoch, stages = 1, ["written", "committed"]
    for i, stage in enumerate(stages):
        _kill_at_then_resume(ref, tmp_path / str(i), epoch, stage)


def test_legacy_stage_names_still_pause(ref, tmp_path):
    """``written`` / ``renamed`` (older tests use them): the state is the first file published after the commit."""
    folder = tmp_path / "k"
    _kill_when_paused(_start(ref["data"], tmp_path, "k", pause="2:renamed"), folder, "renamed")
    assert ckpt.read_manifest(str(folder))["epoch"] == 2
    assert ckpt.load_state(ckpt.state_path(str(folder), "last"))["epoch"] == 2
    assert (folder / "last.safetensors.tmp").exists()  # committed, not yet published
    _finish(_start(ref["data"], tmp_path, resume=folder))
    _assert_same(folder, ref["fp"])


def test_twenty_random_sigkills_then_resume_equals_reference(ref, tmp_path):
    """10 trials, each a fresh run killed at a random moment, then a --resume killed at another, then --resume to
    the end. Every kill lands on a live child (a finished one waits to be killed), wherever the clock puts it:
    in training, in a commit, or after the end. Whatever the moment, the result is the reference, bit for bit."""
    rng = random.Random(0)
    span = ref["seconds"] * 1.1
    kills = 0
    for trial in range(10):
        out = tmp_path / str(trial)
        folder = out / "k"
        _kill(_start_and_sleep(_start(ref["data"], out, "k", hold=True), rng.uniform(0, span)))
        kills += 1
        if ckpt.read_manifest(str(folder)) is None:  # killed before its first commit: the same command again
            assert not (folder / "last.state.pt").exists()
            _kill(_start_and_sleep(_start(ref["data"], out, "k", hold=True), rng.uniform(0, span)))
        else:
            _kill(_start_and_sleep(_start(ref["data"], out, resume=folder, hold=True), rng.uniform(0, span)))
        kills += 1
        if ckpt.read_manifest(str(folder)) is None:  # (never removed by hand: the folder is restarted)
            _finish(_start(ref["data"], out, "k"))
        else:
            _finish(_start(ref["data"], out, resume=folder))
        _assert_same(folder, ref["fp"])
    assert kills == 20


@pytest.mark.parametrize("then", ["same_command", "resume"])
@pytest.mark.parametrize("how", ["SIGKILL:0:setup", "SIGKILL:1:wrote:last_ema.safetensors", "SIGTERM:0:setup"])
def test_stopped_before_the_first_commit_then_same_command_or_resume_equals_reference(ref, tmp_path, how, then):
    """Killed before anything was committed: at the end of the setup (args.yaml written, no step taken) by SIGKILL
    or by SIGTERM (which stops it at its first step, exit 143), or by SIGKILL inside the first commit (its temps,
    one of them a 0600 safetensors file, left behind). The same command, or `--resume RUN`, starts the run again
    in its folder (no dead end, nothing removed by hand), the dead writer's temps are removed, and the run ends
    as the uninterrupted one, bit for bit."""
    sig, pause = how.split(":", 1)
    stage = pause.split(":", 1)[1]
    folder = tmp_path / "k"
    proc = _start(ref["data"], tmp_path, "k", pause=pause)
    if sig == "SIGKILL":
        _kill_when_paused(proc, folder, stage)
    else:
        marker = folder / _commit_faults.MARKER
        while not (marker.exists() and marker.read_text() == stage):
            assert proc.is_alive(), f"the child ended before its setup was done:\n{_log_tail(proc)}"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)
        os.remove(marker)  # let it go on: it stops at its first step
        proc.join()
        assert proc.exitcode == 143, _log_tail(proc)
    names = set(os.listdir(folder))
    assert ckpt.read_manifest(str(folder)) is None and {"args.yaml", "log.txt"} <= names
    assert not names & set(COMMITTED)
    temps = sorted(n for n in names if run_folder.is_stale_temp(n))
    if stage.startswith("wrote:"):
        assert temps == ["last.state.pt.tmp", "last_ema.safetensors.tmp"]
    else:
        assert temps == []
    assert (LOCK_NAME in names) == (sig == "SIGKILL")  # a SIGTERM'ed run released its lock
    if then == "same_command":
        _finish(_start(ref["data"], tmp_path, "k"))
    else:
        _finish(_start(ref["data"], tmp_path, resume=folder))
    _assert_same(folder, ref["fp"])


def test_leftover_temporaries_are_cleaned_at_the_next_start(ref, tmp_path):
    """A commit killed before its manifest landed leaves temps; the next start deletes them (they were never
    committed) and the run ends as the reference. Planted garbage temps in a finished run are ignored too."""
    folder = tmp_path / "k"
    _kill_when_paused(_start(ref["data"], tmp_path, "k", pause="2:written"), folder, "written")
    left = {n for n in os.listdir(folder) if n.endswith(ckpt.TMP)}
    assert {"last.state.pt.tmp", "last.safetensors.tmp", "summary.csv.tmp", "checkpoint.json.tmp"} <= left
    assert ckpt.read_manifest(str(folder))["epoch"] == 1  # the temps are not trusted: epoch 1 is what counts
    assert len(_rows(folder)) == 1
    _finish(_start(ref["data"], tmp_path, resume=folder))
    _assert_same(folder, ref["fp"])

    # garbage under every temp name of a finished run: a start of it changes no committed byte and removes them
    before = {n: (folder / n).read_bytes() for n in (*COMMITTED, ckpt.MANIFEST)}
    for n in ckpt._commit_names():
        (folder / (n + ckpt.TMP)).write_bytes(b"half a file")
    _finish(_start(ref["data"], tmp_path, resume=folder))  # all epochs done: it only starts and ends
    assert {n: (folder / n).read_bytes() for n in before} == before
    _assert_same(folder, ref["fp"])


def test_changed_committed_file_is_refused(ref, tmp_path):
    folder = tmp_path / "k"
    shutil.copytree(ref["root"] / "runs" / "ref", folder)
    ckpt.recover(str(folder))  # a clean copy passes
    data = bytearray((folder / "best.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "best.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="best.safetensors is missing or differs"):
        ckpt.recover(str(folder))
