"""Bad invocations of `ttt-zoo`: one `error: <what>; <how to fix>` line on stderr, exit status 2, no traceback
(`--debug` shows it); a run never reports a wrong best; nothing is overwritten without --force; normal file modes.

Everything runs in-process (`ttt_zoo.cli.main`) on tiny models and the digits folder helper."""
import os
import shutil

import pytest
import torch
import yaml

from _train_data import make_tiny_digits

from ttt_zoo.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--model", "vit3_tiny", "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4",
        "--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0",
        "--log-interval", "100", "-b", "16"]


def cli(capsys, *argv):
    """(exit status, stderr) of `ttt-zoo ARGV` run in this process."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Data folders (full, without val/, one class), a finished 1-of-2-epoch run, existing output files."""
    root = tmp_path_factory.mktemp("cli")
    data = make_tiny_digits(str(root / "digits"))  # 40 train, 20 val images, 10 classes
    noval = str(root / "noval")
    shutil.copytree(os.path.join(data, "train"), os.path.join(noval, "train"))
    one = root / "one"
    for split in ("train", "val"):
        shutil.copytree(os.path.join(data, split, "3"), one / split / "3")
    out = root / "runs"
    main(["train", "--data-dir", data, "--output", str(out), *TINY, "--experiment", "run", "--epochs", "2",
          "--stop-after", "1"])
    import timm
    other = timm.create_model("vit3_tiny", depth=1, embed_dim=32, num_heads=2, patch_size=4, img_size=16,
                              num_classes=10)
    torch.save(other.state_dict(), root / "random.pth")
    ro = root / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    existing = root / "existing"
    existing.mkdir()
    for name in ("x.png", "m.onnx", "map.png", "r.csv", "r.json"):
        (existing / name).write_text("keep")
    (existing / "bench").mkdir()
    (existing / "bench" / "bench.md").write_text("keep")
    return dict(data=data, noval=noval, one=str(one), out=str(out), run=str(out / "run"),
                random=str(root / "random.pth"), ro=str(ro), existing=str(existing))


@pytest.fixture
def read_only(env, monkeypatch):
    """env['ro'] is mode 0555; root ignores that, so there the OS calls fail as on a read-only mount."""
    if os.geteuid() == 0:
        import errno
        import tempfile
        from ttt_zoo.train import trainer
        real_mkstemp, real_makedirs = tempfile.mkstemp, os.makedirs

        def refuse(real):
            def f(*a, **k):
                where = str(k.get("dir") or (a[0] if a else ""))
                if where.startswith(env["ro"]):
                    raise OSError(errno.EROFS, "Read-only file system", where)
                return real(*a, **k)
            return f
        monkeypatch.setattr(tempfile, "mkstemp", refuse(real_mkstemp))
        monkeypatch.setattr(trainer.os, "makedirs", refuse(real_makedirs))
    return env["ro"]


def _train(env, *extra):
    return ["train", "--data-dir", env["data"], "--output", env["out"], *TINY, "--epochs", "1", *extra]


# (name, argv from env, key phrase of the first line)
BAD = [
    ("data-dir missing", lambda e: _train(e, "--data-dir", "/nope"), "--data-dir '/nope' is not a folder"),
    ("epochs 0", lambda e: _train(e, "--epochs", "0"), "--epochs: 0 is out of range"),
    ("num-classes below the data's", lambda e: _train(e, "--num-classes", "5"), "has 10 classes"),
    ("model-kwargs not a number", lambda e: _train(e, "--model-kwargs", "depth=four"), "--model-kwargs"),
    ("lr nan", lambda e: _train(e, "--lr", "nan"), "--lr: nan is not a finite number"),
    ("model typo", lambda e: _train(e, "--model", "vit3_tinyy", "--experiment", "typo"), "not a registered model"),
    ("img-size 0", lambda e: _train(e, "--img-size", "0", "--experiment", "typo"), "--img-size: 0 is out of range"),
    ("resume changed --opt", lambda e: ["train", "--resume", e["run"], "--opt", "adamw"], "--opt 'adamw' differs"),
    ("resume changed shape", lambda e: ["train", "--resume", e["run"], "--model-kwargs", "depth=2"],
     "--model-kwargs {'depth': 2} differs"),
    ("initial-checkpoint does not fit", lambda e: _train(e, "--initial-checkpoint", e["random"], "--experiment",
                                                         "init"), "does not fit"),
    ("no val/ folder", lambda e: _train(e, "--data-dir", e["noval"], "--experiment", "nv"), "--val-split 0.1"),
    ("one class", lambda e: _train(e, "--data-dir", e["one"], "--experiment", "one"), "at least 2 class"),
    ("val-split fraction out of range", lambda e: _train(e, "--val-split", "1.5"), "between 0 and 1"),
    ("parse error", lambda e: _train(e, "--epochs", "x"), "--epochs: 'x' is not an integer"),
    ("sample non-diffusion model", lambda e: ["sample", "--model", "vit3_tiny", "--out",
                                              os.path.join(e["out"], "s.png")], "not a diffusion model"),
    ("sample existing --out", lambda e: ["sample", "--model", "dit3_s_2", "--tiny", "--steps", "1", "--out",
                                         os.path.join(e["existing"], "x.png")], "add --force"),
    ("export existing --out", lambda e: ["export", "--model", "t5_tiny", "--model-kwargs", "depth=1", "--out",
                                         os.path.join(e["existing"], "m.onnx")], "add --force"),
    ("attention-map existing --out", lambda e: ["attention-map", "--model", "vit3_tiny", "--query-pixel", "1", "1",
                                                "--out", os.path.join(e["existing"], "map.png")], "add --force"),
    ("validate existing --results-file", lambda e: ["validate", "--checkpoint", e["run"], "-j", "0",
                                                    "--results-file", os.path.join(e["existing"], "r.csv")],
     "add --force"),
    ("sample upscale 0", lambda e: ["sample", "--model", "dit3_s_2", "--tiny", "--upscale", "0", "--out",
                                    os.path.join(e["out"], "u.png")], "--upscale: 0 is out of range"),
    ("list filter matching nothing", lambda e: ["list", "--filter", "vit4*"], "no registered model matches"),
    ("validate without model", lambda e: ["validate", "--data-dir", e["data"], "--pretrained"], "no model"),
    ("bench existing --results-file", lambda e: ["bench", "--model", "vit3_tiny", "--device", "cpu",
                                                 "--results-file", os.path.join(e["existing"], "r.json")],
     "add --force"),
    ("bench existing --output", lambda e: ["bench", "--model", "vit3_tiny", "--device", "cpu", "--output",
                                           os.path.join(e["existing"], "bench")], "bench.md; add --force"),
    ("predict no image matched", lambda e: ["predict", os.path.join(e["out"], "*.jpg"), "--checkpoint", e["run"],
                                            "-j", "0"], "no image matched"),
    ("predict unreadable image", lambda e: ["predict", os.path.join(e["existing"], "x.png"), "--checkpoint", e["run"],
                                            "-j", "0"], "cannot read 1 of 1 image(s)"),
    ("predict missing checkpoint", lambda e: ["predict", os.path.join(e["data"], "val"), "--checkpoint",
                                              os.path.join(e["out"], "nope.safetensors")], "does not exist"),
    ("predict existing --results-file", lambda e: ["predict", os.path.join(e["data"], "val"), "--checkpoint",
                                                   e["run"], "-j", "0", "--results-file",
                                                   os.path.join(e["existing"], "r.csv")], "add --force"),
]
# every command with --model suggests the close names (ttt_zoo.registry.resolve_model_name), as create_model does
BAD += [(f"{argv[0]} model typo", (lambda argv: lambda e: [a(e) if callable(a) else a for a in argv])(argv),
         f"Did you mean {hint}")
        for argv, hint in [
            (["validate", "--model", "vit3_tinny", "--data-dir", lambda e: e["data"], "--pretrained"], "'vit3_tiny'"),
            (["predict", lambda e: os.path.join(e["data"], "val"), "--model", "vit3_tinny", "-j", "0"], "'vit3_tiny'"),
            (["sample", "--model", "dit3_s2", "--out", lambda e: os.path.join(e["out"], "s.png")], "'dit3_s_2'"),
            (["attention-map", "--model", "vit3_tinny", "--query-pixel", "1", "1", "--out",
              lambda e: os.path.join(e["out"], "m.png")], "'vit3_tiny'"),
            (["export", "--model", "vit3_tinny", "--out", lambda e: os.path.join(e["out"], "m.onnx")], "'vit3_tiny'"),
            (["bench", "--model", "vit3_tinny", "--device", "cpu"], "'vit3_tiny'"),
            (["train", "--model", "vit3_tinny", "--data-dir", lambda e: e["data"], "--output",
              lambda e: e["out"], "--experiment", "typo2"], "'vit3_tiny'")]]
# issue 36: every out-of-range number it lists is refused at parse time in one line naming the flag
BAD += [(f"{argv[0]} {argv[1]} {argv[2]}", (lambda argv: lambda e: argv)(argv), f"argument {flag}: ")
        for argv, flag in [
            (["train", "--lr", "-1"], "--lr"), (["train", "--weight-decay", "-5"], "--weight-decay"),
            (["train", "--min-lr", "-1"], "--min-lr"), (["train", "--warmup-lr", "-1"], "--warmup-lr"),
            (["train", "--clip-grad", "-1"], "--clip-grad"), (["train", "--smoothing", "5"], "--smoothing"),
            (["train", "--drop", "2"], "--drop"), (["train", "--drop-path", "3"], "--drop-path"),
            (["train", "--img-size", "100000"], "--img-size"),
            (["train", "--model-kwargs", "depth=100000"], "--model-kwargs"),
            (["predict", "--crop-pct", "-1"], "--crop-pct"), (["predict", "-j", "-1"], "-j/--workers"),
            (["validate", "-b", "0"], "-b/--batch-size"), (["validate", "--img-size", "0"], "--img-size"),
            (["sample", "--steps", "-3"], "--steps"), (["sample", "--upscale", "100000"], "--upscale")]]
RO = [
    ("train read-only --output", lambda ro, e: _train(e, "--output", ro, "--experiment", "x"), "not writable"),
    ("sample read-only --out", lambda ro, e: ["sample", "--model", "dit3_s_2", "--tiny", "--steps", "1", "--out",
                                              os.path.join(ro, "x.png")], "cannot write"),
    ("validate read-only --results-file", lambda ro, e: ["validate", "--checkpoint", e["run"], "-j", "0",
                                                         "--results-file", os.path.join(ro, "r.csv")],
     "cannot write"),
]


def _record(name, argv, rc, line, err):
    """``TTT_ZOO_CLI_TABLE=FILE`` (``experiments/cli_errors_table.py``): one JSON line per row as it ran."""
    path = os.environ.get("TTT_ZOO_CLI_TABLE")
    if path:
        import json
        with open(path, "a") as f:
            f.write(json.dumps(dict(name=name, argv=[str(a) for a in argv], rc=rc, first_line=line,
                                    lines=len(err.strip().splitlines()), traceback="Traceback" in err)) + "\n")


def _check_one_line(rc, err, phrase, fix=True):
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert lines and lines[-1].startswith("error: ") and phrase in lines[-1], err
    assert ";" in lines[-1] or not fix, f"no fix in {lines[-1]!r}"  # "<what was wrong>; <how to fix it>"
    return lines[-1]


@pytest.mark.parametrize("name,argv,phrase", BAD, ids=[b[0] for b in BAD])
def test_bad_invocation_one_line(env, capsys, name, argv, phrase):
    before = sorted(os.listdir(env["out"]))
    rc, err = cli(capsys, *argv(env))
    line = _check_one_line(rc, err, phrase)
    assert [ln for ln in err.splitlines() if "error" in ln.lower()] == [line]  # exactly one error line
    _record(name, argv(env), rc, line, err)
    assert sorted(os.listdir(env["out"])) == before  # no run folder left behind, nothing new written
    assert sorted(os.listdir(env["existing"])) == ["bench", "m.onnx", "map.png", "r.csv", "r.json", "x.png"]
    assert all(open(os.path.join(env["existing"], n)).read() == "keep" for n in ("x.png", "m.onnx", "r.csv"))


@pytest.mark.parametrize("name,argv,phrase", RO, ids=[r[0] for r in RO])
def test_read_only_output_one_line(env, read_only, capsys, name, argv, phrase):
    rc, err = cli(capsys, *argv(read_only, env))
    _record(name, argv(read_only, env), rc, _check_one_line(rc, err, phrase), err)
    assert os.listdir(read_only) == []


def test_failed_start_does_not_block_the_same_command(env, capsys):
    argv = _train(env, "--model", "vit3_tinyy", "--experiment", "again")
    for _ in range(2):  # the second run fails the same way, not with "already exists"
        rc, err = cli(capsys, *argv)
        assert rc == 2 and "not a registered model" in err and "already exists" not in err
    assert not os.path.exists(os.path.join(env["out"], "again"))


def test_debug_shows_the_traceback(env, capsys):
    rc, err = cli(capsys, *_train(env, "--data-dir", "/nope"), "--debug")
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: --data-dir")


def _nan_after(epoch_from, monkeypatch):
    from ttt_zoo.train import classification
    real = classification.ClassificationTask.train_step
    state = {"epoch": 0}

    def step(self, model, batch):
        loss, extras = real(self, model, batch)
        return (loss * float("nan") if state["epoch"] >= epoch_from else loss), extras
    monkeypatch.setattr(classification.ClassificationTask, "train_step", step)
    from ttt_zoo.train import trainer
    real_epoch = trainer.Trainer.train_one_epoch

    def one_epoch(self, epoch):
        state["epoch"] = epoch
        return real_epoch(self, epoch)
    monkeypatch.setattr(trainer.Trainer, "train_one_epoch", one_epoch)


def test_non_finite_loss_stops_and_never_becomes_best(env, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(env["run"], run)
    files = {n: (run / n).read_bytes() for n in ("best.safetensors", "best.state.pt", "last.safetensors",
                                                   "last.state.pt", "summary.csv")}
    _nan_after(1, monkeypatch)  # epoch 1 (the resumed one) trains on NaN
    rc, err = cli(capsys, "train", "--resume", str(run))
    line = _check_one_line(rc, err, "training loss of epoch 1 is nan")
    assert "best.* is unchanged" in line
    assert {n: (run / n).read_bytes() for n in files} == files  # best, last and summary untouched


def test_no_validation_split_fraction_and_no_eval(env, tmp_path, capsys):
    base = ["train", "--data-dir", env["noval"], "--output", str(tmp_path), *TINY, "--epochs", "1"]
    assert cli(capsys, *base, "--experiment", "f", "--val-split", "0.25")[0] == 0
    args = yaml.safe_load((tmp_path / "f" / "args.yaml").read_text())
    assert args["val_split"] == "0.25" and args["seed"] == 42  # the hold-out is recorded and seeded
    import csv
    (row,) = list(csv.DictReader(open(tmp_path / "f" / "summary.csv")))
    assert "eval_top1" in row and (tmp_path / "f" / "best.safetensors").exists()
    assert cli(capsys, *base, "--experiment", "n", "--no-eval")[0] == 0
    names = os.listdir(tmp_path / "n")
    assert "last.safetensors" in names and not [n for n in names if n.startswith("best")]  # no best without eval


def test_val_split_fraction_is_disjoint_and_seeded():
    import argparse
    from ttt_zoo.train.classification import ClassificationTask
    task = ClassificationTask(argparse.Namespace(val_split="0.25", seed=7), None)
    train, held = task._holdout(40)
    assert len(held) == 10 and not set(train) & set(held) and sorted(train + held) == list(range(40))
    assert task._holdout(40) == (train, held)
    assert ClassificationTask(argparse.Namespace(val_split="0.25", seed=8), None)._holdout(40)[1] != held


def test_resume_and_validate_read_the_run_args(env, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(env["run"], run)
    rc, err = cli(capsys, "train", "--resume", str(run))  # args.yaml supplies the rest
    assert rc == 0, err
    assert torch.load(run / "last.state.pt", weights_only=True)["epoch"] == 2
    rc, err = cli(capsys, "validate", "--checkpoint", str(run), "-j", "0", "--results-file",
                  str(tmp_path / "r.json"))
    assert rc == 0, err
    import json
    rows = json.load(open(tmp_path / "r.json"))
    assert [r["img_size"] for r in rows] == [16, 16] and rows[0]["model"] == "vit3_tiny"
    # a command-line flag overrides args.yaml: another depth no longer fits the weights
    rc, err = cli(capsys, "validate", "--checkpoint", str(run), "-j", "0", "--model-kwargs", "depth=2",
                  "embed_dim=16", "num_heads=2", "patch_size=4")
    _check_one_line(rc, err, "does not fit", fix=False)  # ttt_zoo.checkpoint's message: "... Build the model ..."


def test_force_replaces_and_files_get_the_normal_mode(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        out = tmp_path / "s.png"
        argv = ["sample", "--model", "dit3_s_2", "--tiny", "--steps", "1", "--labels", "1", "--out", out]
        assert cli(capsys, *argv)[0] == 0
        first = out.read_bytes()
        rc, err = cli(capsys, *argv)
        _check_one_line(rc, err, "--force")
        assert out.read_bytes() == first
        assert cli(capsys, *argv, "--force", "--seed", "1")[0] == 0 and out.read_bytes() != first
        from ttt_zoo.fileio import atomic_path, atomic_write
        atomic_write(str(tmp_path / "a.json"), "{}")
        atomic_write(str(tmp_path / "b.yaml"), "a: 1\n")
        with atomic_path(str(tmp_path / "c.onnx")) as tmp:
            open(tmp, "wb").write(b"x")
        for name in ("s.png", "a.json", "b.yaml", "c.onnx"):
            assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
        assert sorted(os.listdir(tmp_path)) == ["a.json", "b.yaml", "c.onnx", "s.png"]  # no temporaries left
    finally:
        os.umask(old)


def _full_disk(*args, **kwargs):
    import errno
    raise OSError(errno.ENOSPC, "No space left on device")  # as torch.save / save_file raise it: no file name


def test_full_disk_is_one_line_naming_the_file_and_no_dead_end(env, tmp_path, capsys, monkeypatch):
    """A full disk inside an epoch commit (torch.save) and inside convert (safetensors' save_file): one line naming
    the file and saying what to do, exit 2; the same commands then succeed once there is space again."""
    import safetensors.torch
    out = tmp_path / "runs"
    train = ["train", "--data-dir", env["data"], "--output", out, *TINY, "--epochs", "1", "--experiment", "fd"]
    with monkeypatch.context() as m:
        m.setattr(torch, "save", _full_disk)
        rc, err = cli(capsys, *train)
    lines = err.strip().splitlines()
    assert rc == 2 and lines[-1].startswith("error: ") and "Traceback" not in err, err
    assert "last.state.pt: no space left on its disk" in lines[-1] and "committing epoch 1" in lines[-1], lines[-1]
    assert cli(capsys, *train)[0] == 0  # space again: the same command runs
    hub_out = tmp_path / "hub"
    convert = ["convert", out / "fd" / "last.safetensors", "--model", "vit3_tiny.fd", "--model-kwargs", "depth=1",
               "embed_dim=16", "num_heads=2", "patch_size=4", "img_size=16", "num_classes=10", "--out", hub_out,
               "--no-flops"]
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", _full_disk)
        rc, err = cli(capsys, *convert)
    assert rc == 2 and err.count("\n") == 1 and f"{hub_out}: no space left on its disk" in err, err
    assert not hub_out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".hub")] == []
    assert cli(capsys, *convert)[0] == 0 and (hub_out / "model.safetensors").is_file()


# ----- issue 45, items 4 and 6: weights and preprocessing numbers checked where they enter -----

KW = ["depth=1", "embed_dim=16", "num_heads=2", "patch_size=4"]


@pytest.fixture(scope="module")
def damaged(env, tmp_path_factory):
    """Weights of the TINY model: NaN, int32 and a transposed head; a Hub folder and copies of it whose config.json
    has absurd preprocessing numbers."""
    import json
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("damaged")
    good = load_file(os.path.join(env["run"], "best.safetensors"))
    files = dict(nan=dict(good, **{"head.bias": torch.full((10,), float("nan"))}),
                 int32={k: (v * 100).to(torch.int32) if v.is_floating_point() else v for k, v in good.items()},
                 transposed=dict(good, **{"head.weight": good["head.weight"].t().contiguous()}))
    out = {k: str(root / f"{k}.safetensors") for k in files}
    for k, sd in files.items():
        save_file(sd, out[k])
    save_file(good, root / "good.safetensors")
    hub = root / "hub"
    assert main(["convert", str(root / "good.safetensors"), "--model", "vit3_tiny.ok", "--model-kwargs", *KW,
                 "img_size=16", "num_classes=10", "--out", str(hub), "--no-flops"]) in (0, None)
    for name, key, value in [("std", "std", [1e-300] * 3), ("crop", "crop_pct", 1e-9),
                             ("size", "input_size", [3, 60000, 60000])]:
        shutil.copytree(hub, root / f"hub_{name}")
        cfg = json.loads((root / f"hub_{name}" / "config.json").read_text())
        cfg["pretrained_cfg"][key] = value
        (root / f"hub_{name}" / "config.json").write_text(json.dumps(cfg))
        out[f"hub_{name}"] = str(root / f"hub_{name}")
    out["root"] = str(root)
    return out


def _weights_args(w):
    return ["--model", "vit3_tiny", "--checkpoint", w, "--model-kwargs", *KW, "--img-size", "16", "--num-classes",
            "10", "-j", "0"]


def _convert(w, d):
    return ["convert", w, "--model", "vit3_tiny.x", "--model-kwargs", *KW, "img_size=16", "num_classes=10", "--out",
            os.path.join(d["root"], "out"), "--no-flops"]


#: (name, argv from (env, damaged), phrase of the one line); before (24f08df): a traceback, a blame of the learning
#: rate, or exit 0 with the damage kept
WEIGHT_CASES = [
    ("hub std 1e-300", lambda e, d: ["predict", os.path.join(e["data"], "val", "3"), "--checkpoint", d["hub_std"],
                                     "-j", "0"], "'pretrained_cfg.std' is [1e-300, 1e-300, 1e-300]"),
    ("hub crop_pct 1e-9", lambda e, d: ["predict", os.path.join(e["data"], "val", "3"), "--checkpoint",
                                        d["hub_crop"], "-j", "0"], "'pretrained_cfg.crop_pct' is 1e-09"),
    ("hub input_size 60000", lambda e, d: ["predict", os.path.join(e["data"], "val", "3"), "--checkpoint",
                                           d["hub_size"], "-j", "0"], "'pretrained_cfg.input_size' is [3, 60000"),
    ("train --model-kwargs features_only", lambda e, d: _train(e, "--model-kwargs", "features_only=True"),
     "features_only=True is not a constructor argument"),
    ("validate --model-kwargs device", lambda e, d: ["validate", "--data-dir", e["data"], "--checkpoint", e["run"],
                                                     "--model-kwargs", "device='cpu'"],
     "device='cpu' is not a constructor argument; the commands place the model themselves: use --device"),
    ("convert --model-args features_only", lambda e, d: ["convert", e["random"], "--model", "vit3_tiny.x",
                                                         "--model-args", '{"features_only": true}', "--out",
                                                         os.path.join(d["root"], "out")], "features_only=True"),
    ("validate transposed head", lambda e, d: ["validate", "--data-dir", e["data"], *_weights_args(d["transposed"])],
     "head.weight is stored transposed: (16, 10) where a Linear's weight is (classes, features) = (10, 16)"),
    ("train --initial-checkpoint NaN", lambda e, d: _train(e, "--initial-checkpoint", d["nan"], "--experiment", "n"),
     "nan.safetensors: tensor 'head.bias' holds NaN (10 of 10 values)"),
    ("train --initial-checkpoint int32", lambda e, d: _train(e, "--initial-checkpoint", d["int32"], "--experiment",
                                                             "i"), "is stored as int32, but the model's is float32"),
    ("convert NaN weights", lambda e, d: _convert(d["nan"], d), "nan.safetensors: tensor 'head.bias' holds NaN"),
    ("convert int32 weights", lambda e, d: _convert(d["int32"], d), "int32.safetensors: tensor 'blocks.0."),
    ("predict NaN weights", lambda e, d: ["predict", os.path.join(e["data"], "val", "3"),
                                          *_weights_args(d["nan"])], "holds NaN"),
]


@pytest.mark.parametrize("name,argv,phrase", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_weights_and_preprocessing_one_line(env, damaged, capsys, name, argv, phrase):
    before = sorted(os.listdir(env["out"]))
    rc, err = cli(capsys, *argv(env, damaged))
    line = _check_one_line(rc, err, phrase)
    _record(name, argv(env, damaged), rc, line, err)
    assert "--lr" not in line and "num_classes=16" not in line and "Build the model" not in line
    assert sorted(os.listdir(env["out"])) == before and not os.path.exists(os.path.join(damaged["root"], "out"))


_OOM = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                    "tried to allocate 2415919104 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("command", ["validate", "predict"])
def test_out_of_memory_is_one_line_naming_a_size_that_fits(env, capsys, monkeypatch, command):
    """An allocation that fails (here as torch's CPU allocator fails at --img-size 8192) is one line saying which
    --img-size / -b needs a quarter of the memory."""
    def no_memory(*a, **k):
        raise _OOM
    monkeypatch.setattr(torch.nn.Conv2d, "forward", no_memory)
    where = ["--data-dir", env["data"]] if command == "validate" else [os.path.join(env["data"], "val", "3")]
    rc, err = cli(capsys, command, *where, "--checkpoint", env["run"], "-j", "0", "--img-size", "8192", "-b", "8")
    _check_one_line(rc, err, "out of memory allocating 2.2 GiB at --img-size 8192, -b 8: memory grows with the "
                             "image area and the batch size; give --img-size 4096 (a quarter of the memory) or -b 2")


def test_channels_last_inputs_work_in_every_family():
    """``model(x.to(memory_format=torch.channels_last))`` gives the output of the contiguous input, every family."""
    import timm
    from ttt_zoo.registry import list_zoo_families
    for name in list_zoo_families(include_diffusion=True).values():
        if name.startswith("dit"):
            kw, x, extra = dict(hidden_size=32, depth=1, num_heads=2), torch.randn(2, 4, 16, 16), (
                torch.tensor([1, 2]), torch.tensor([0, 1]))
        else:
            kw = (dict(embed_dim=(16, 32), depths=(1, 1), num_heads=(2, 2)) if name.startswith("hvit3") else
                  dict(embed_dim=16, depths=(1, 1), head_dim=(8, 8)) if name.startswith("visionttt_h") else
                  dict(embed_dim=32, depth=1, head_dim=16) if name.startswith("visionttt") else
                  dict(embed_dim=32, depth=1, num_heads=2))
            x, extra = torch.randn(2, 3, 96, 96), ()
        torch.manual_seed(0)
        model = timm.create_model(name, **kw).eval()
        with torch.no_grad():
            want = model(x, *extra)
            got = model(x.to(memory_format=torch.channels_last), *extra)
            got_cl = model.to(memory_format=torch.channels_last)(x.to(memory_format=torch.channels_last), *extra)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(got_cl, want, rtol=1e-5, atol=1e-5, msg=name)


# ----- issue 49 item 6: the former raw tracebacks, each one line that says what to do -----

HUB_MODEL = "hf-hub:ttt-zoo/vit3_tiny.in1k"  # never in the test's empty cache; the hub is offline (conftest)
HUB_PHRASES = ("from the Hugging Face Hub repo 'ttt-zoo/vit3_tiny.in1k'", "offline mode is on (HF_HUB_OFFLINE=1)",
               "not in the Hugging Face cache", "Download it once online (unset HF_HUB_OFFLINE)", "'local-dir:PATH'")
HUB = [
    ("validate --model hf-hub offline", lambda e: ["validate", "--model", HUB_MODEL, "--data-dir", e["data"],
                                                   "--pretrained", "-j", "0"]),
    ("predict --model hf-hub offline", lambda e: ["predict", os.path.join(e["data"], "val"), "--model", HUB_MODEL,
                                                  "-j", "0"]),  # was a raw LocalEntryNotFoundError traceback
    ("attention-map --model hf-hub offline", lambda e: ["attention-map", "--model", HUB_MODEL, "--query-pixel", "1",
                                                        "1", "--out", os.path.join(e["out"], "hub.png")]),
    ("export --model hf-hub offline", lambda e: ["export", "--model", HUB_MODEL, "--out",
                                                 os.path.join(e["out"], "hub.onnx")]),
    ("train --model hf-hub offline", lambda e: _train(e, "--model", HUB_MODEL, "--experiment", "hub")),
    ("sample --model hf-hub offline", lambda e: ["sample", "--model", "hf-hub:ttt-zoo/dit3_b_2.in1k_256",
                                                  "--out", os.path.join(e["out"], "hub.png")]),
    pytest.param("bench --model hf-hub offline", lambda e: ["bench", "--model", HUB_MODEL, "--device", "cpu"],
                 marks=pytest.mark.xfail(strict=True, reason="cli/bench.py reports each failed configuration in its "
                                                             "table (the Hub's own message) and goes on")),
]


@pytest.mark.parametrize("name,argv", HUB, ids=[h.values[0] if hasattr(h, "values") else h[0] for h in HUB])
def test_bad_invocation_hub_offline(env, hf_cache, capsys, name, argv):
    """``--model hf-hub:...`` offline without a cached copy: one line naming the repo, the offline switch and the
    cache, and the two ways out, in every command (the line of ``ttt_zoo.checkpoint.hub_unavailable_error``)."""
    before = sorted(os.listdir(env["out"]))
    rc, err = cli(capsys, *argv(env))
    _record(name, argv(env), rc, (err.strip().splitlines() or [""])[-1], err)  # the xfail rows too: what they print
    repo = next(a for a in argv(env) if a.startswith("hf-hub:"))[len("hf-hub:"):]
    phrases = [p.replace(HUB_MODEL[len("hf-hub:"):], repo) for p in HUB_PHRASES]  # the command's own repo named
    line = _check_one_line(rc, err, phrases[0], fix=False)  # "<what>. <how to fix>": the shared message
    assert all(p in line for p in phrases), line
    assert hf_cache in line, line
    assert [ln for ln in err.splitlines() if "error" in ln.lower()] == [line]
    assert sorted(os.listdir(env["out"])) == before


def test_bad_invocation_checkpoint_hf_hub(env, hf_cache, capsys):
    """``--checkpoint`` takes a file or a run folder: an ``hf-hub:`` id there is one line saying what it takes."""
    argv = ["validate", "--checkpoint", HUB_MODEL, "--data-dir", env["data"], "-j", "0"]
    rc, err = cli(capsys, *argv)
    _record("validate --checkpoint hf-hub", argv, rc, _check_one_line(rc, err, "does not exist; give a weights file"),
            err)


def test_hub_offline_in_python(hf_cache, monkeypatch):
    """What a Python user sees: timm's own ``create_model('hf-hub:...')`` raises huggingface_hub's error (timm is
    not patched); ttt_zoo's ``create_model``, hubconf's and ``load_folder`` raise the CheckpointError of the CLI
    line."""
    import timm
    from huggingface_hub.errors import LocalEntryNotFoundError
    monkeypatch.syspath_prepend(ROOT)
    import hubconf
    import ttt_zoo
    from ttt_zoo.errors import CheckpointError
    from ttt_zoo.hub import load_folder
    with pytest.raises(LocalEntryNotFoundError):
        timm.create_model(HUB_MODEL)
    for load in (ttt_zoo.create_model, hubconf.create_model, load_folder):
        with pytest.raises(CheckpointError) as info:
            load(HUB_MODEL)
        assert all(p in str(info.value) for p in HUB_PHRASES), (load, info.value)


FEATURES_PHRASE = "has no features_only: DiT, DiT3 and DiT5 are diffusion models"


@pytest.mark.parametrize("name", ["dit_s_2", "dit3_s_2", "dit5_s_2", "dit3_b_2.in1k_256"])
def test_features_only_of_a_diffusion_model_is_one_clear_error(name):
    """``timm.create_model('dit3_s_2', features_only=True)`` was an AttributeError from timm's FeatureListNet: now
    a RuntimeError (what timm raises for a model without a feature path) that says what to use instead, and one
    ``error:`` line at the CLI boundary."""
    import timm
    from ttt_zoo.cli._common import error_line
    with pytest.raises(RuntimeError, match=FEATURES_PHRASE) as info:
        timm.create_model(name, features_only=True, pretrained=False)
    line = error_line(info.value)
    assert line.startswith(f"error: {name.split('.')[0]} {FEATURES_PHRASE}") and "\n" not in line, line
    assert "model.blocks[i]" in line and "vit3_*, hvit3_*, visionttt_*" in line, line


def test_every_model_has_features_only_or_says_why():
    """The registry walked (a new model cannot slip past): every zoo model either builds with ``features_only=True``
    (on the meta device: no memory, no weights) or raises :class:`NoFeaturesError`; every diffusion model raises it."""
    import timm
    from ttt_zoo.errors import NoFeaturesError
    from ttt_zoo.registry import is_diffusion_model, list_zoo_models
    refused, names = [], [n for n in list_zoo_models(include_diffusion=True) if not n.startswith("dit_")]
    assert any(n.startswith("dit3_") for n in names) and any(n.startswith("dit5_") for n in names)
    for name in names:
        try:
            with torch.device("meta"):
                model = timm.create_model(name, features_only=True)
        except NoFeaturesError:
            refused.append(name)
            continue
        assert model.feature_info.channels(), name  # a real feature path: timm's FeatureInfo
    assert refused == [n for n in names if is_diffusion_model(n)]


def test_features_only_of_plain_dit_is_one_clear_error():
    import timm
    with pytest.raises(RuntimeError, match=FEATURES_PHRASE):
        timm.create_model("dit_s_2", features_only=True)


DET = "configs_det/mask-rcnn_hvit3-t_fpn_1x_coco.py"
SEG = "configs_seg/upernet_vit3-t_160k_ade20k-512x512.py"


def _fake_module(name, **attrs):
    import importlib.machinery
    import types
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


def _mmengine_without(package):
    """mmengine 0.10.7's Config.fromfile on a config whose base is ``package::...`` with ``package`` missing (its
    ``_get_cfg_path``: ``ModuleNotFoundError(f'{package} is not installed, please install {package} manually')``)."""
    class Config:
        @staticmethod
        def fromfile(path, import_custom_modules=True):
            raise ModuleNotFoundError(f"{package} is not installed, please install {package} manually")
    config = _fake_module("mmengine.config", Config=Config)
    return {"mmengine": _fake_module("mmengine", config=config), "mmengine.config": config}


# (case, tool, config, importable fakes, blocked modules, key phrase): each package `make openmmlab` installs, missing
MM = [
    ("mmengine", "train", DET, [], ["mmengine"], "no module named 'mmengine' (mmengine 0.10.7 is not installed"),
    ("pkg_resources", "train", DET, ["mmengine"], ["pkg_resources"],
     "no module named 'pkg_resources' (mmengine needs setuptools < 82"),
    ("mmcv", "test", SEG, ["mmengine", "pkg_resources"], ["mmcv"],
     "no module named 'mmcv' (mmcv 2.1.0 is not installed"),
    ("mmdet", "train", DET, ["pkg_resources", "mmcv", "mmdet:missing"], ["mmdet"],
     "no module named 'mmdet' (mmdet 3.3.0 is not installed"),
    ("mmseg", "train", SEG, ["pkg_resources", "mmcv", "mmsegmentation:missing"], ["mmseg"],
     "no module named 'mmseg' (mmsegmentation 1.2.2 is not installed"),
]


@pytest.mark.parametrize("case,tool,config,present,blocked,phrase", MM, ids=[m[0] for m in MM])
def test_bad_invocation_mm_before_make_openmmlab(monkeypatch, capsys, case, tool, config, present, blocked, phrase):
    """``tools/mm_{train,test}.py CONFIG`` before ``make openmmlab``: one line naming the missing package and
    ``make openmmlab``, exit status 2 (was mmengine's / Python's ModuleNotFoundError traceback)."""
    import sys
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))  # first: it reads pkg_resources when imported
    for name in present:
        if name.endswith(":missing"):  # mmengine reads the config and finds its base package missing
            for mod_name, mod in _mmengine_without(name.split(":")[0]).items():
                monkeypatch.setitem(sys.modules, mod_name, mod)
        else:
            monkeypatch.setitem(sys.modules, name, _fake_module(name))
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.chdir(ROOT)
    import mm_tools
    monkeypatch.setattr(sys, "argv", [f"tools/mm_{tool}.py", config])
    with pytest.raises(SystemExit) as info:
        mm_tools.main(tool)
    err = capsys.readouterr().err
    line = _check_one_line(info.value.code, err, phrase)
    assert err.strip() == line and "run `make openmmlab`" in line, err
    _record(f"mm_{tool} without {case}", ["python", f"tools/mm_{tool}.py", config], info.value.code, line, err)


def test_bad_invocation_mm_train_script_without_openmmlab():
    """The script as the README runs it, every OpenMMLab package blocked: exit status 2 and only the one line."""
    import subprocess
    import sys
    code = ("import runpy, sys\n"
            "for m in ('mmengine', 'pkg_resources', 'mmcv', 'mmdet', 'mmseg'): sys.modules[m] = None\n"
            f"sys.path.insert(0, 'tools'); sys.argv = ['tools/mm_train.py', {DET!r}]\n"
            "runpy.run_path('tools/mm_train.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1"))
    line = _check_one_line(proc.returncode, proc.stderr, "no module named 'mmengine'")
    assert proc.stderr.strip() == line and "run `make openmmlab`" in line and proc.stdout == "", proc.stderr
    _record("mm_train script, no OpenMMLab", ["python", "tools/mm_train.py", DET], proc.returncode, line, proc.stderr)


@pytest.mark.parametrize("toolbox", ["mmdet", "mmseg"])
def test_adapter_entry_without_its_toolbox_says_make_openmmlab(monkeypatch, toolbox):
    """``custom_imports=['ttt_zoo.adapters.mmdet']`` (or a plain import) without the toolbox: Python's
    ModuleNotFoundError, its message naming the toolbox and ``make openmmlab``."""
    import importlib
    import sys
    monkeypatch.setitem(sys.modules, toolbox, None)
    monkeypatch.delitem(sys.modules, f"ttt_zoo.adapters.{toolbox}", raising=False)
    with pytest.raises(ModuleNotFoundError, match=rf"no module named '{toolbox}' \(.*run `make openmmlab`") as info:
        importlib.import_module(f"ttt_zoo.adapters.{toolbox}")
    assert info.value.name == toolbox
