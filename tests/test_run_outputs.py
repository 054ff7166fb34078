"""Only `ttt-zoo train` writes into a run folder (issue 45 items 1 and 5).

Every output flag of every command, pointed into a live run folder (its lock held as a running `train` holds it)
or at the folder itself, with --force, is refused in one `error:` line (exit 2), and the folder's bytes (names,
modes, sha256) stay the same. The (command, flag) pairs come from the parsers themselves: a new flag that looks like
an output and is not in OUTPUTS (or NOT_OUTPUTS) fails the test. Also: a live lock is never copied or replaced,
stale temps of dead writers are removed by the next write, Ctrl-C is one line and exit status 130.

Everything runs in-process (`ttt_zoo.cli.main`) on a tiny run, except what needs a real signal."""
import argparse
import hashlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from _train_data import make_tiny_digits

from ttt_zoo.cli import build_parser, main
from ttt_zoo.fileio import folder_lock

KW = ["depth=1", "embed_dim=16", "num_heads=2", "patch_size=4"]
TINY = ["--model", "vit3_tiny", "--model-kwargs", *KW, "--img-size", "16", "--workers", "0", "--opt", "sgd",
        "--lr", "0.05", "--warmup-epochs", "0", "--log-interval", "100", "-b", "16"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: a dest that may name something written (the walk below checks every parser's actions against it)
OUTPUT_LIKE = re.compile(r"(^|_)(out|outs|output|outputs|outdir|result|results|save|dest|target|export|dir|file|"
                         r"path|folder|root)(_|$)")

# (command, dest) -> (kind, [argv builders]): each builder takes the fixture and the target path
OUTPUTS = {
    ("data digits", "out"): ("folder", [lambda e, t: ["data", "digits", "--out", t]]),
    ("demo", "output"): ("folder", [lambda e, t: ["demo", "--output", t, "--epochs", "1"]]),
    ("train", "output"): ("folder", [lambda e, t: ["train", "--data-dir", e["data"], "--output", t, *TINY,
                                                   "--experiment", "nested", "--epochs", "1"]]),
    ("validate", "results_file"): ("file", [lambda e, t: ["validate", "--checkpoint", e["run"], "--data-dir",
                                                          e["data"], "-j", "0", "--results-file", t, "--force"]]),
    ("predict", "results_file"): ("file", [lambda e, t: ["predict", e["image"], "--checkpoint", e["run"],
                                                         "--results-file", t, "--force"]]),
    ("predict", "results_dir"): ("folder", [lambda e, t: ["predict", e["image"], "--checkpoint", e["run"],
                                                          "--results-dir", t, "--force"]]),
    ("sample", "out"): ("file", [lambda e, t: ["sample", "--tiny", "--steps", "1", "--out", t, "--force"]]),
    ("attention-map", "out"): ("file", [lambda e, t: ["attention-map", "--checkpoint", e["run"], "--image",
                                                      e["image"], "--query-pixel", "1", "1", "--out", t,
                                                      "--force"]]),
    ("convert", "out"): ("folder", [
        lambda e, t: ["convert", e["run"], "--model", "vit3_tiny.mine", "--no-flops", "--out", t, "--force"],
        lambda e, t: ["convert", e["sd3"], "--sd3", "--out", t, "--force"]]),
    ("convert", "out_root"): ("folder", [lambda e, t: ["convert", "--all", "--checkpoint-dir", e["sources"],
                                                       "--filter", e["tag"], "--no-flops", "--out-root", t,
                                                       "--force"]]),
    ("export", "out"): ("file", [lambda e, t: ["export", "--checkpoint", e["run"], "--out", t, "--force"]]),
    ("bench", "results_file"): ("file", [lambda e, t: ["bench", "--model", "vit3_tiny", "--img-size", "16",
                                                       "--results-file", t, "--force"]]),
    ("bench", "output"): ("folder", [lambda e, t: ["bench", "--model", "vit3_tiny", "--img-size", "16",
                                                   "--output", t, "--force"]]),
}

#: dests that look like outputs but write nothing, and why
NOT_OUTPUTS = {
    ("validate", "data_dir"): "read only",
    ("predict", "data_dir"): "read only",
    ("train", "data_dir"): "read only",
    ("train", "drop_path"): "a rate, not a path",
    ("push", "folder"): "the Hub folder to upload: read only",
    ("convert", "checkpoint_dir"): "read; --all --download writes the authors' files into it (needs the network: "
                                   "see cli/convert.py)",
    ("predict", "exclude_output"): "a switch: leave the output column out",
    ("predict", "output_type"): "prob or logit",
    ("predict", "output_col"): "a column name",
    ("predict", "results_format"): "the formats of --results-file / --results-dir",
    ("predict", "results_separate_col"): "a switch: one column per top-k entry",
    ("predict", "no_console_results"): "a switch: no results on stdout",
}

#: cases that still write into the run: the owner's one-line fix, until then a strict xfail (so a fix is noticed)
PENDING: dict = {}


def _walk(parser: argparse.ArgumentParser, path: str = ""):
    """(command path, action) of every action of every subparser, `train`'s own parser included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}".strip())
        elif path == "train" and action.dest == "argv":  # `train` hands its arguments to the trainer's parser
            from ttt_zoo.train.args import build_parser as train_parser
            yield from ((path, a) for a in train_parser()._actions)
        else:
            yield path, action


def output_flags():
    return sorted({(cmd, a.dest) for cmd, a in _walk(build_parser()) if OUTPUT_LIKE.search(a.dest)})


def test_every_output_flag_is_in_the_table():
    flags = output_flags()
    missing = [f for f in flags if f not in OUTPUTS and f not in NOT_OUTPUTS]
    assert not missing, (f"output-like flags without a case in OUTPUTS (or a reason in NOT_OUTPUTS): {missing}; "
                         f"add how each is used, so that it is checked against run folders")
    stale = [f for f in [*OUTPUTS, *NOT_OUTPUTS] if f not in flags]
    assert not stale, f"no parser has these flags any more: {stale}"


# ----- a live run folder -----

def snapshot(folder: str):
    """{relative name: (kind, mode, sha256 or link target)} of everything under ``folder``, itself included."""
    out = {".": ("dir", stat.S_IMODE(os.lstat(folder).st_mode), None)}
    for here, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = os.path.join(here, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                what = ("link", 0, os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                what = ("dir", stat.S_IMODE(st.st_mode), None)
            else:
                with open(p, "rb") as f:
                    what = ("file", stat.S_IMODE(st.st_mode), hashlib.sha256(f.read()).hexdigest())
            out[os.path.relpath(p, folder)] = what
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from ttt_zoo.hub import registered_pretrained
    root = tmp_path_factory.mktemp("outs")
    data = make_tiny_digits(str(root / "digits"))
    runs = root / "runs"
    assert main(["train", "--data-dir", data, "--output", str(runs), *TINY, "--experiment", "run",
                 "--epochs", "1"]) == 0
    run = runs / "run"
    image = os.path.join(data, "val", "0", sorted(os.listdir(os.path.join(data, "val", "0")))[0])
    (root / "link").symlink_to(run)  # outside the run, pointing at it: its real path is inside
    sd3 = root / "sd3"  # enough of an SD3 transformer folder to pass the source checks
    sd3.mkdir()
    (sd3 / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    (sd3 / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    tag = registered_pretrained()[0]
    sources = root / "sources"  # a source for `convert --all` (never read: the output is refused first)
    sources.mkdir()
    (sources / f"{tag}.pth").write_bytes(b"")
    return dict(root=str(root), data=data, runs=str(runs), run=str(run), image=image, link=str(root / "link"),
                sd3=str(sd3), sources=str(sources), tag=tag)


#: where each kind of output is pointed: RUN is the run folder, LINK a symlink outside it pointing at it
TARGETS = {"folder": ["RUN", "RUN/", "RUN/new", "LINK", "LINK/new"],
           "file": ["RUN", "RUN/", "RUN/summary.csv", "RUN/best.safetensors", "RUN/new.EXT", "LINK/new.EXT"]}
EXT = {("sample", "out"): ".png", ("attention-map", "out"): ".png", ("export", "out"): ".onnx"}

#: flags that take only .csv / .json: a target with another extension (or none) may be refused for that first,
#: which is fine (nothing is written either way)
TABLE_FILES = {("validate", "results_file"), ("predict", "results_file"), ("bench", "results_file")}
#: (flag, target) that write beside the run, not into it: the flag's own extension is appended
BESIDE = {(("predict", "results_file"), "RUN"): "RUN.csv"}


def _cases():
    for flag, (kind, builders) in OUTPUTS.items():
        for i in range(len(builders)):
            for target in TARGETS[kind]:
                case = (flag, i, target)
                mark = [pytest.mark.xfail(strict=True, reason=PENDING[flag])] if flag in PENDING else []
                yield pytest.param(case, marks=mark, id=f"{flag[0]}--{flag[1]}-{i}-{target}")


def _path(env, flag, target: str) -> str:
    path = target.replace("RUN", env["run"]).replace("LINK", env["link"])
    return path.replace(".EXT", EXT.get(flag, ".csv"))


def _run(argv, capsys):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr()


def _no_demo_writes(monkeypatch):
    """`demo` past its checks would write the digits and train for minutes: fail at once instead."""
    def reached(*a, **k):
        raise AssertionError("demo reached a writer: its --output was not refused first")
    import ttt_zoo.train.digits
    import ttt_zoo.train.trainer
    monkeypatch.setattr(ttt_zoo.train.digits, "make_digits_folder", reached)
    monkeypatch.setattr(ttt_zoo.train.trainer, "main", reached)


def _remove_new(folder: str, before) -> None:
    """Undo what a failing case wrote into the module's run (the next cases start from the same folder)."""
    import shutil
    for rel in sorted(set(snapshot(folder)) - set(before), key=len):
        p = os.path.join(folder, rel)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.unlink(p)


@pytest.mark.parametrize("case", list(_cases()))
def test_output_into_a_live_run_is_refused(env, case, capsys, monkeypatch):
    flag, i, target = case
    if flag[0] == "demo":
        _no_demo_writes(monkeypatch)
    argv = OUTPUTS[flag][1][i](env, _path(env, flag, target))
    with folder_lock(env["run"], "ttt-zoo train"):  # as a running `train` holds it
        before = snapshot(env["run"])
        try:
            rc, out = _run(argv, capsys)
            assert snapshot(env["run"]) == before, argv
        finally:
            _remove_new(env["run"], before)
    if (flag, target) in BESIDE:
        written = _path(env, flag, BESIDE[flag, target])
        assert rc == 0 and os.path.isfile(written), out.err[-2000:]
        os.unlink(written)
        return
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert rc == 2, (argv, rc, out.err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, out.err[-2000:])
    if not (flag in TABLE_FILES and os.path.splitext(target)[1] not in (".csv", ".EXT")):
        assert "only `ttt-zoo train` writes there" in lines[0], (argv, lines[0])
    assert not [n for n in os.listdir(env["runs"]) if n != "run"], os.listdir(env["runs"])  # nothing beside it


# ----- a live lock is never copied or replaced -----

def test_a_folder_with_a_live_lock_is_not_replaced(tmp_path):
    from ttt_zoo.errors import HubFolderError
    from ttt_zoo.hub.staging import staged_folder
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with folder_lock(str(out), "ttt-zoo train"):
        before = snapshot(str(out))
        with pytest.raises(HubFolderError, match="in use"):
            with staged_folder(str(out), overwrite=True) as tmp:
                open(os.path.join(tmp, "new.txt"), "w").write("new")
        assert snapshot(str(out)) == before
        assert sorted(os.listdir(tmp_path)) == ["out"]  # no partial folder left


def test_a_live_lock_taken_after_the_check_is_not_replaced(tmp_path):
    import contextlib
    from ttt_zoo.errors import HubFolderError
    from ttt_zoo.hub.staging import staged_folder
    out = tmp_path / "out"
    out.mkdir()
    lock = contextlib.ExitStack()
    with pytest.raises(HubFolderError, match="in use"):
        with staged_folder(str(out), overwrite=True) as tmp:
            open(os.path.join(tmp, "new.txt"), "w").write("new")
            lock.enter_context(folder_lock(str(out), "ttt-zoo train"))  # a writer starts meanwhile
            before = snapshot(str(out))
    with lock:
        assert snapshot(str(out)) == before
        assert sorted(os.listdir(tmp_path)) == ["out"]


def test_swap_keeps_extra_files_but_never_a_lock_file(tmp_path):
    from ttt_zoo.hub.staging import staged_folder
    out = tmp_path / "out"
    out.mkdir()
    (out / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (out / ".ttt-zoo.lock").write_text("12345\n")  # left by a killed holder: no live lock
    (out / ".sub.lock").write_text("12345\n")
    with staged_folder(str(out), overwrite=True) as tmp:
        open(os.path.join(tmp, "model.bin"), "w").write("new")
    assert sorted(os.listdir(out)) == [".gitattributes", "model.bin"]


def test_staged_files_get_the_normal_mode(tmp_path):
    """safetensors' save_file (the Hub folder's model.safetensors) creates its file 0600."""
    import torch
    from safetensors.torch import save_file
    from ttt_zoo.fileio import NORMAL_DIR_MODE, NORMAL_MODE
    from ttt_zoo.hub.staging import staged_folder
    out = tmp_path / "out"
    with staged_folder(str(out)) as tmp:
        save_file({"w": torch.ones(1)}, os.path.join(tmp, "model.safetensors"))
        os.mkdir(os.path.join(tmp, "sub"), 0o700)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == NORMAL_MODE
    assert stat.S_IMODE((out / "sub").stat().st_mode) == NORMAL_DIR_MODE


def test_convert_writes_model_safetensors_with_the_normal_mode(env, tmp_path, capsys):
    from ttt_zoo.fileio import NORMAL_MODE
    out = tmp_path / "hub"
    rc, cap = _run(["convert", os.path.join(env["run"], "last.safetensors"), "--model", "vit3_tiny.mine",
                    "--model-kwargs", *KW, "img_size=16", "num_classes=10", "--no-flops", "--out", out], capsys)
    assert rc == 0, cap.err[-2000:]
    modes = {n: stat.S_IMODE((out / n).stat().st_mode) for n in os.listdir(out)}
    assert modes and all(m == NORMAL_MODE for m in modes.values()), modes


# ----- temps of killed writers -----

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_dead_writers_temps_are_removed_by_the_next_write(tmp_path):
    from ttt_zoo.fileio import atomic_write
    out = tmp_path / "m.onnx"
    dead = tmp_path / f".tmp-m-{_dead_pid()}-0123abcd.onnx"
    live = tmp_path / f".tmp-m-{os.getppid()}-0123abcd.onnx"  # a live writer (our parent process)
    other = tmp_path / f".tmp-other-{_dead_pid()}-0123abcd.onnx"  # another target's: not ours to judge here
    for p in (dead, live, other):
        p.write_bytes(b"partial")
    atomic_write(str(out), b"model", binary=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["m.onnx", live.name, other.name])


_KILLED_EXPORT = textwrap.dedent("""
    import sys, time, torch
    class Program:  # the exporter's result: its save() writes part of the file, then hangs until killed
        def save(self, path):
            open(path, "wb").write(b"partial")
            print("saving", flush=True)
            time.sleep(600)
    torch.onnx.export = lambda *a, **k: Program()
    from ttt_zoo.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_killed_export_leaves_a_temp_the_next_export_removes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "m.onnx"
    argv = ["export", "--model", "vit3_tiny", "--model-kwargs", *KW, "--img-size", "16", "16", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", _KILLED_EXPORT, *argv], stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == b"saving"
    finally:
        p.kill()
        p.wait()
    left = os.listdir(tmp_path)
    assert len(left) == 1 and left[0].startswith(".tmp-m-") and left[0].endswith(".onnx"), left

    import torch

    class Program:
        def save(self, path):
            open(path, "wb").write(b"onnx")
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: Program())
    rc, cap = _run(argv, capsys)
    assert rc == 0, cap.err[-2000:]
    assert os.listdir(tmp_path) == ["m.onnx"] and out.read_bytes() == b"onnx"


def test_sigterm_during_export_removes_its_temp(tmp_path):
    out = tmp_path / "m.onnx"
    argv = ["export", "--model", "vit3_tiny", "--model-kwargs", *KW, "--img-size", "16", "16", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", _KILLED_EXPORT, *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == b"saving"
        p.terminate()
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert p.returncode == 143 and lines == ["error: stopped (SIGTERM); nothing was written"], err.decode()[-2000:]
    assert os.listdir(tmp_path) == []


# ----- Ctrl-C -----

def _interrupt(*a, **k):
    raise KeyboardInterrupt


@pytest.mark.parametrize("command", ["validate", "predict", "export"])
def test_ctrl_c_is_one_line_and_exit_130(env, command, tmp_path, capsys, monkeypatch):
    import torch
    import ttt_zoo.cli.predict
    import ttt_zoo.train.validate
    monkeypatch.setattr(ttt_zoo.train.validate, "validate", _interrupt)
    monkeypatch.setattr(ttt_zoo.cli.predict, "_predict", _interrupt)
    monkeypatch.setattr(torch.onnx, "export", _interrupt)
    argv = {"validate": ["validate", "--checkpoint", env["run"], "--data-dir", env["data"], "-j", "0",
                         "--results-file", tmp_path / "r.csv"],
            "predict": ["predict", env["image"], "--checkpoint", env["run"], "--results-file", tmp_path / "r.csv"],
            "export": ["export", "--checkpoint", env["run"], "--out", tmp_path / "m.onnx"]}[command]
    rc, cap = _run(argv, capsys)
    assert rc == 130, cap.err[-2000:]
    assert cap.err.strip().splitlines() == ["error: interrupted (Ctrl-C); nothing was written"]
    assert os.listdir(tmp_path) == []


def test_ctrl_c_says_which_outputs_were_kept(tmp_path, capsys):
    from ttt_zoo.cli._common import run_command
    from ttt_zoo.fileio import atomic_write

    def half_done():
        atomic_write(str(tmp_path / "a.csv"), "x\n")
        raise KeyboardInterrupt
    assert run_command(half_done) == 130
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: interrupted (Ctrl-C); written in full before it and kept: ")
    assert str(tmp_path / "a.csv") in line and "\n" not in line


_SLOW_PREDICT = textwrap.dedent("""
    import sys, time
    import ttt_zoo.cli.predict as predict
    def slow(*a, **k):
        print("predicting", flush=True)
        time.sleep(600)
    predict._predict = slow
    from ttt_zoo.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_sigint_during_predict_is_one_line_and_exit_130(env, tmp_path):
    penv = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    argv = ["predict", env["image"], "--checkpoint", env["run"], "--results-file", str(tmp_path / "r.csv")]
    # as a terminal's foreground job: SIGINT at its default (a job started with `&` by a shell without job
    # control, e.g. CI launched in the background, inherits SIGINT ignored, and Python then keeps ignoring it)
    p = subprocess.Popen([sys.executable, "-c", _SLOW_PREDICT, *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=penv, cwd=ROOT,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.readline().strip() == b"predicting"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    assert p.returncode == 130, err.decode()[-2000:]
    assert lines == ["error: interrupted (Ctrl-C); nothing was written"], lines
    assert os.listdir(tmp_path) == []
