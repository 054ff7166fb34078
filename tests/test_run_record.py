"""The run record and resume (issue 45 items 0 and 2): every command builds a run's model from the folder alone, a
T5 run made with --linearize-from included; resume extends the schedule, applies --lr, checks other data by class
names and refuses what it would not apply; the one hash check follows symlinks; committed files get the normal
mode."""
import csv
import json
import os
import shutil
import stat

import pytest
import torch

from _train_data import make_tiny_digits
from test_cli_errors import cli

from ttt_zoo import run_folder
from ttt_zoo.checkpoint import CheckpointError

KW = ["depth=1", "embed_dim=16", "num_heads=2", "patch_size=4"]
FLAGS = ["--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0", "-b", "8",
         "--log-interval", "100", "--device", "cpu"]
VIT3 = ["--model", "vit3_tiny", "--model-kwargs", *KW, *FLAGS]


def _lr_column(folder):
    with open(os.path.join(folder, "summary.csv"), newline="") as f:
        return [float(r["lr"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    data = make_tiny_digits(str(root / "digits"))
    return {"root": root, "data": data}


def _train(capsys, env, name, *extra, epochs=2):
    rc, err = cli(capsys, "train", "--data-dir", env["data"], "--output", env["root"] / "runs", *VIT3,
                  "--experiment", name, "--epochs", epochs, *extra)
    assert rc == 0, err
    return env["root"] / "runs" / name


# ----- a T5 run made with --linearize-from: every command reads it without --model -----

@pytest.fixture(scope="module")
def t5_run(env):
    import timm
    from safetensors.torch import save_file
    from ttt_zoo.cli import main
    root = env["root"]
    src = timm.create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=1, embed_dim=16, num_heads=2,
                            num_classes=10)
    save_file(src.state_dict(), str(root / "deit.safetensors"))
    assert main(["train", "--linearize-from", "deit_tiny_patch16_224", "--initial-checkpoint",
                 str(root / "deit.safetensors"), "--model-kwargs", "patch_size=4", "depth=1", "embed_dim=16",
                 "num_heads=2", *FLAGS, "--data-dir", env["data"], "--output", str(root / "runs"),
                 "--experiment", "t5", "--epochs", "1"]) == 0
    return root / "runs" / "t5"


def test_t5_run_records_the_model_it_became(t5_run):
    import timm
    from safetensors.torch import load_file
    rec = run_folder.read_record(str(t5_run))
    assert rec["model"] == "t5_tiny" and rec["linearize_from"] == "deit_tiny_patch16_224"
    assert rec["num_classes"] == 10 and rec["class_names"] == [str(c) for c in range(10)]
    assert rec["data_dir"] == os.path.realpath(rec["data_dir"]) and os.path.isabs(rec["data_dir"])
    model = timm.create_model(rec["model"], **rec["model_kwargs"])  # by name from the record alone
    model.load_state_dict(load_file(str(t5_run / "best.safetensors")), strict=True)


def test_every_reader_takes_the_t5_run_without_model(t5_run, env, capsys, tmp_path):
    data = env["data"]
    rc, err = cli(capsys, "validate", "--checkpoint", t5_run, "-j", 0, "--device", "cpu")
    assert rc == 0, err
    rc, err = cli(capsys, "predict", os.path.join(data, "val", "3"), "--checkpoint", t5_run, "--device", "cpu",
                  "--results-file", tmp_path / "p.csv")
    assert rc == 0, err
    rc, err = cli(capsys, "export", "--checkpoint", t5_run, "--out", tmp_path / "t5.onnx")
    assert rc == 0, err
    rc, err = cli(capsys, "attention-map", "--checkpoint", t5_run, "--query-pixel", 5, 5, "--out",
                  tmp_path / "map.png")
    assert rc == 0, err
    rc, err = cli(capsys, "convert", t5_run, "--model", "t5_tiny.digits", "--out", tmp_path / "hub", "--no-flops")
    assert rc == 0, err
    rc, err = cli(capsys, "push", tmp_path / "hub", "--source", t5_run, "--dry-run")
    assert rc == 0, err


def test_export_and_attention_map_use_the_run_size_and_classes(t5_run, tmp_path, capsys):
    import onnx
    from ttt_zoo.cli import main
    rc, err = cli(capsys, "export", "--checkpoint", t5_run, "--out", tmp_path / "a.onnx")
    assert rc == 0, err
    g = onnx.load(str(tmp_path / "a.onnx")).graph
    assert g.output[0].type.tensor_type.shape.dim[-1].dim_value == 10  # the run's classes, not 1000
    assert main(["attention-map", "--checkpoint", str(t5_run), "--query-pixel", "5", "5", "--out",
                 str(tmp_path / "m.png")]) == 0
    assert "of (4, 4)" in capsys.readouterr().out  # the run's 16 px (4 x 4 tokens of 4 px), not 224 px


# ----- resume tells the truth -----

def test_resume_to_more_epochs_extends_the_schedule(env, capsys):
    from timm.scheduler import CosineLRScheduler
    folder = _train(capsys, env, "more", epochs=2)
    rc, err = cli(capsys, "train", "--resume", folder, "--epochs", 4)
    assert rc == 0, err
    lrs = _lr_column(folder)
    # the reference: timm's cosine schedule built for 4 epochs of 5 updates, stepped per update (as the trainer)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    sched = CosineLRScheduler(opt, t_initial=4 * 5, lr_min=0.0, warmup_t=0, t_in_epochs=False)
    want = [sched._get_lr(e * 5)[0] for e in range(4)]
    assert lrs[2:] == pytest.approx(want[2:], rel=1e-9) and min(lrs) > 0, lrs
    assert lrs[:2] == pytest.approx([0.05, 0.025], rel=1e-9)  # the first two epochs ran the 2-epoch schedule
    assert run_folder.read_record(str(folder))["epochs"] == 4
    assert "--epochs 2 -> 4 from epoch 2" in (folder / "log.txt").read_text()


def test_resume_with_lr_applies_and_records_it(env, capsys):
    folder = _train(capsys, env, "lr", epochs=2)
    rc, err = cli(capsys, "train", "--resume", folder, "--epochs", 3, "--lr", 0.2)
    assert rc == 0, err
    lrs = _lr_column(folder)
    # epoch 2 of a 3-epoch cosine schedule from 0.2: 0.2 * (1 + cos(pi * 2/3)) / 2
    assert lrs[2] == pytest.approx(0.2 * 0.25, rel=1e-9), lrs
    import yaml
    assert yaml.safe_load((folder / "args.resume-epoch2.yaml").read_text())["lr"] == 0.2
    assert run_folder.read_record(str(folder))["lr"] == 0.2


@pytest.mark.parametrize("flag,value", [("--weight-decay", "0.1"), ("--momentum", "0.5")])
def test_resume_refuses_what_the_optimizer_state_overrides(env, capsys, flag, value):
    folder = _train(capsys, env, f"opt{flag}", epochs=1)
    before = sorted(os.listdir(folder))
    rc, err = cli(capsys, "train", "--resume", folder, "--epochs", 2, flag, value)
    assert rc == 2 and err.count("\n") == 1 and flag in err and "optimizer state" in err, err
    assert sorted(os.listdir(folder)) == before


def test_resume_num_classes_names_the_run_value(env, capsys):
    folder = _train(capsys, env, "nc", epochs=1)
    rc, err = cli(capsys, "train", "--resume", folder, "--num-classes", 5)
    assert rc == 2 and "differs from the run's 10" in err and "None" not in err, err


def test_resume_to_fewer_epochs_is_refused(env, capsys):
    folder = _train(capsys, env, "fewer", epochs=2)
    rc, err = cli(capsys, "train", "--resume", folder, "--epochs", 1)
    assert rc == 2 and "already committed 2 epochs" in err, err


def test_resume_data_by_class_names(env, capsys, tmp_path, monkeypatch):
    folder = _train(capsys, env, "data", epochs=1)
    other = tmp_path / "other"
    shutil.copytree(env["data"], other)
    os.rename(other / "train" / "9", other / "train" / "nine")
    os.rename(other / "val" / "9", other / "val" / "nine")
    rc, err = cli(capsys, "train", "--resume", folder, "--epochs", 2, "--data-dir", other)
    assert rc == 2 and "classes differ" in err and "nine" in err, err
    same = tmp_path / "same"
    shutil.copytree(env["data"], same)
    monkeypatch.chdir(tmp_path)  # a relative --data-dir: recorded as its real path
    rc, err = cli(capsys, "train", "--resume", folder, "--epochs", 2, "--data-dir", "same")
    assert rc == 0 and "the same 10 classes" in err, err
    assert run_folder.read_record(str(folder))["data_dir"] == str(same.resolve())


def test_resume_from_another_folder_reads_the_recorded_data(env, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(env["root"])
    rc, err = cli(capsys, "train", "--data-dir", "digits", "--output", "runs", *VIT3, "--experiment", "rel",
                  "--epochs", 1)
    assert rc == 0, err
    monkeypatch.chdir(tmp_path)  # no digits/ here: the recorded absolute path is used
    rc, err = cli(capsys, "train", "--resume", env["root"] / "runs" / "rel", "--epochs", 2)
    assert rc == 0, err


# ----- the one hash check, on real paths -----

def test_symlinks_are_checked_at_their_target(env, capsys, tmp_path):
    folder = _train(capsys, env, "links", epochs=1)
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    data = bytearray((copy / "best.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "best.safetensors").write_bytes(bytes(data))
    link = tmp_path / "elsewhere.safetensors"
    os.symlink(copy / "best.safetensors", link)  # a link outside the run to a corrupted committed file
    with pytest.raises(CheckpointError, match="differs from what"):
        run_folder.committed_file(str(link))
    good = tmp_path / "run2"
    shutil.copytree(folder, good)
    os.remove(good / "best.safetensors")
    os.symlink(copy / "best.safetensors", good / "best.safetensors")  # a link inside the run to another file
    with pytest.raises(CheckpointError, match="differs from what"):
        run_folder.committed_file(str(good / "best.safetensors"))
    assert run_folder.committed_file(str(folder / "best.safetensors"))  # the intact run passes


def test_committed_files_get_the_normal_mode(env, capsys):
    folder = _train(capsys, env, "modes", epochs=1)
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(folder):
        if not name.startswith("."):
            assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o666 & ~umask, name


@pytest.mark.parametrize("extra,says", [(["--pretrained"], "--pretrained"),
                                        (["--experiment", "elsewhere"], "not in"),
                                        (["--output", "/tmp"], "not in")])
def test_resume_refuses_flags_it_would_not_use(env, capsys, extra, says):
    folder = env["root"] / "runs" / "unused"
    if not folder.exists():
        _train(capsys, env, "unused", epochs=1)
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    rc, err = cli(capsys, "train", "--resume", folder, "--epochs", 2, *extra)
    assert rc == 2 and err.count("\n") == 1 and says in err, err
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before


def test_predict_names_a_non_utf8_file_with_escapes(env, capsys, tmp_path):
    folder = env["root"] / "runs" / "unused"
    if not folder.exists():
        _train(capsys, env, "unused", epochs=1)
    src = os.path.join(env["data"], "val", "3")
    os.makedirs(tmp_path / "imgs")
    shutil.copy(os.path.join(src, sorted(os.listdir(src))[0]), os.fsencode(str(tmp_path / "imgs")) + b"/caf\xe9.png")
    rc, err = cli(capsys, "predict", tmp_path / "imgs", "--checkpoint", folder, "--device", "cpu",
                  "--results-file", tmp_path / "p.csv")
    assert rc == 0 and "not UTF-8" in err, err
    assert "caf\\xe9.png" in (tmp_path / "p.csv").read_text()


def test_convert_a_run_with_only_a_tag(t5_run, tmp_path, capsys):
    rc, err = cli(capsys, "convert", t5_run, "--tag", "lin", "--out", tmp_path / "hub", "--no-flops")
    assert rc == 0, err
    cfg = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert cfg["architecture"] == "t5_tiny" and cfg["label_names"] == [str(c) for c in range(10)]
