"""`ttt-zoo train` in one process: outputs, config YAML, exact resume, --linearize-from, nothing-lost guards."""
import errno
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from _train_data import make_tiny_digits

from ttt_zoo.train import run_state as ckpt
from ttt_zoo.train.args import parse_args
from ttt_zoo.train.trainer import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "vit3_tiny", "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4",
        "--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0",
        "--val-split", "val", "--log-interval", "100", "-b", "16"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_digits(str(tmp_path_factory.mktemp("digits")))  # 40 train (2 steps at -b 16), 20 val


def _run(data, out, *extra):
    main(["--data-dir", data, "--output", str(out), *TINY, *extra])


def _state(folder, tag="last"):
    return ckpt.load_state(ckpt.state_path(str(folder), tag))


def _weights(path):
    from safetensors.torch import load_file
    return load_file(path)


def test_config_yaml_sets_defaults_and_cli_overrides(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"batch_size": 7, "lr": 0.5, "smoothing": 0.0, "model_kwargs": {"depth": 2}}))
    args, task_cls = parse_args(["-c", str(cfg), "--lr", "0.25"])
    assert (args.batch_size, args.lr, args.smoothing, args.model_kwargs) == (7, 0.25, 0.0, {"depth": 2})
    assert args.task == "classification" and task_cls.__name__ == "ClassificationTask"
    assert parse_args(["-b", "3", "--model-kwargs", "depth=2", "name=x"])[0].model_kwargs == {"depth": 2, "name": "x"}
    cfg.write_text(yaml.safe_dump({"batch_sise": 7}))
    with pytest.raises(SystemExit):
        parse_args(["-c", str(cfg)])
    with pytest.raises(ValueError, match="Unknown --task"):
        from ttt_zoo.train.task import get_task_class
        get_task_class("nope")


def test_cli_entry_points_pass_flags_through():
    from ttt_zoo.cli import build_parser
    args = build_parser().parse_args(["train", "--model", "x", "-b", "3", "-h"])
    assert args.argv == ["--model", "x", "-b", "3", "-h"]
    out = subprocess.run([sys.executable, "-m", "ttt_zoo", "train", "--help"], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and "--linearize-from" in out.stdout and "--grad-accum-steps" in out.stdout


def test_outputs_and_metrics(data, tmp_path):
    _run(data, tmp_path, "--experiment", "e", "--epochs", "2", "--model-ema", "--model-ema-decay", "0.5")
    folder = tmp_path / "e"
    names = set(os.listdir(folder))
    assert {"args.yaml", "summary.csv", "log.txt", "train_plot.png", "last.safetensors", "last_ema.safetensors",
            "last.state.pt", "best.safetensors", "best.state.pt"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    import csv
    rows = list(csv.DictReader(open(folder / "summary.csv")))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert {"train_loss", "eval_loss", "eval_top1", "eval_top5", "eval_ema_top1", "lr", "train_img_per_sec"} <= set(rows[0])
    assert float(rows[0]["train_img_per_sec"]) > 0
    # progress: a line at the first and the last step of each epoch (--log-interval 100 > 2 steps), with the
    # epoch's and the run's ETA, the throughput, loss and lr
    log = (folder / "log.txt").read_text()
    line = r"train epoch {} \[(\d)/2\] eta \d\d:\d\d run eta \d\d:\d\d img/s \d+ loss \d+\.\d{{4}} lr \S+"
    assert [re.findall(line.format(e), log) for e in (0, 1)] == [["1", "2"], ["1", "2"]], log
    # args.yaml is a valid -c file that reproduces the arguments
    again, _ = parse_args(["-c", str(folder / "args.yaml")])
    assert again.model_kwargs == {"depth": 1, "embed_dim": 16, "num_heads": 2, "patch_size": 4} and again.lr == 0.05
    # weights: safetensors == the state's copy; the state loads with weights_only=True
    state = torch.load(folder / "last.state.pt", weights_only=True)
    w = _weights(str(folder / "last.safetensors"))
    assert w.keys() == state["model"].keys() and all(torch.equal(w[k], state["model"][k]) for k in w)
    assert state["epoch"] == 2 and state["num_updates"] == 4
    # eval_top1 agrees with an independent evaluation of last.safetensors (plain torchvision loop)
    import timm
    import torchvision
    from timm.data import create_transform, resolve_data_config
    model = timm.create_model("vit3_tiny", depth=1, embed_dim=16, num_heads=2, patch_size=4, img_size=16,
                              num_classes=10)
    model.load_state_dict(w)
    model.eval()
    cfg = resolve_data_config({"img_size": 16}, model=model)
    ds = torchvision.datasets.ImageFolder(os.path.join(data, "val"), transform=create_transform(**cfg))
    with torch.no_grad():
        correct = sum(int(model(x[None]).argmax() == y) for x, y in ds)
    assert float(rows[1]["eval_top1"]) == pytest.approx(100.0 * correct / len(ds), abs=1e-9)


def test_refuses_existing_experiment_folder(data, tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match=r"already exists and holds files that are not a ttt-zoo run's \(keep.txt\)"
                                         r".*fresh --experiment"):
        _run(data, tmp_path, "--experiment", "e", "--epochs", "1")
    assert os.listdir(tmp_path / "e") == ["keep.txt"]


def test_exact_resume(data, tmp_path):
    """2 epochs == 1 epoch, stop, --resume 1 more: weights, EMA, optimizer and metrics, with augmentation, mixup,
    drop path, EMA and float16 AMP (GradScaler) on, so the RNG, sampler and scaler states all matter."""
    flags = ["--epochs", "2", "--model-ema", "--model-ema-decay", "0.7", "--mixup", "0.4", "--drop-path", "0.2",
             "--amp", "--opt", "adamw", "--lr", "0.01", "--warmup-epochs", "1", "--sched", "cosine"]
    _run(data, tmp_path, "--experiment", "full", *flags)
    _run(data, tmp_path, "--experiment", "part", *flags, "--stop-after", "1")
    assert _state(tmp_path / "part")["epoch"] == 1
    _run(data, tmp_path, *flags, "--resume", str(tmp_path / "part"))
    a, b = _state(tmp_path / "full"), _state(tmp_path / "part")
    assert b["epoch"] == 2 and b["num_updates"] == a["num_updates"] == 4
    assert b["scaler"] is not None and b["scaler"]["scale"] == a["scaler"]["scale"]

    def close(x, y, what):
        assert x.keys() == y.keys(), what
        for k in x:
            if torch.is_tensor(x[k]) and x[k].is_floating_point():
                assert torch.allclose(x[k], y[k], rtol=1e-6, atol=1e-7), f"{what}: {k}"
    close(a["model"], b["model"], "model")
    close(a["ema"], b["ema"], "ema")
    for s in a["optimizer"]["state"]:
        close(a["optimizer"]["state"][s], b["optimizer"]["state"][s], f"optimizer state {s}")
    assert [g["lr"] for g in a["optimizer"]["param_groups"]] == [g["lr"] for g in b["optimizer"]["param_groups"]]
    init = _weights(str(tmp_path / "part" / "best.safetensors"))  # a sanity check that training moved the weights
    assert any(not torch.equal(init[k], b["model"][k]) for k in init) or b["best_epoch"] == 1
    import csv
    ra = list(csv.DictReader(open(tmp_path / "full" / "summary.csv")))
    rb = list(csv.DictReader(open(tmp_path / "part" / "summary.csv")))
    assert [r["epoch"] for r in rb] == ["0", "1"]
    for col in ("train_loss", "eval_loss", "eval_top1", "eval_ema_loss", "lr"):
        assert float(ra[1][col]) == pytest.approx(float(rb[1][col]), rel=1e-6), col
    assert (tmp_path / "part" / "args.resume-epoch1.yaml").exists()


def test_linearize_from_lr_scale_groups(data, tmp_path):
    """--linearize-from: T5 from a DeiT checkpoint; the new TTT tensors train at 20x through lr_scale, on top of
    timm's layer-decay groups, at every point of the schedule."""
    import timm
    src = timm.create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                            num_classes=10)
    from safetensors.torch import save_file
    save_file(src.state_dict(), str(tmp_path / "deit.safetensors"))
    args = [a for a in TINY if a not in ("--model", "vit3_tiny")]
    args = args[args.index("--img-size"):]
    main(["--data-dir", data, "--output", str(tmp_path), "--experiment", "t5", "--linearize-from",
          "deit_tiny_patch16_224", "--model-kwargs", "patch_size=4", "embed_dim=16", "depth=2",  # size: --img-size
          "num_heads=2", "--initial-checkpoint", str(tmp_path / "deit.safetensors"), *args, "--epochs", "2",
          "--warmup-epochs", "1", "--warmup-lr", "1e-4", "--min-lr", "1e-3", "--layer-decay", "0.5"])
    s = _state(tmp_path / "t5")
    assert any(k.endswith("attn.w1") for k in s["model"])  # it is a T5
    groups = s["optimizer"]["param_groups"]
    new = [g for g in groups if g["name"].startswith("new_")]
    old = {g["name"]: g for g in groups if not g["name"].startswith("new_")}
    assert new and len({g["lr_scale"] for g in old.values()}) > 1  # layer decay really applied
    for g in new:
        twin = old[g["name"][len("new_"):]]
        assert g["lr_scale"] == pytest.approx(20 * twin["lr_scale"])
        assert g["lr"] == pytest.approx(20 * twin["lr"], rel=1e-9)  # at the end of the schedule (min_lr floor)
    with pytest.raises(ValueError, match="--pretrained or --initial-checkpoint"):
        main(["--data-dir", data, "--output", str(tmp_path), "--experiment", "x", "--linearize-from",
              "deit_tiny_patch16_224", *args])


def test_read_only_output_fails_before_training(data, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root ignores permissions: make the OS calls fail as a read-only mount does
        from ttt_zoo.train import trainer

        def erofs(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system")
        monkeypatch.setattr(trainer.os, "makedirs", erofs)
    with pytest.raises(SystemExit, match="not writable"):
        _run(data, ro, "--experiment", "e", "--epochs", "1")
    assert os.listdir(ro) == []


def test_probe_write_failure_fails_before_training(data, tmp_path, monkeypatch):
    real_open = open

    def no_write(path, mode="r", *a, **k):
        if "w" in mode and str(path).endswith(".write_probe.tmp"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr(ckpt, "open", no_write, raising=False)
    with pytest.raises(SystemExit, match="is not writable.*Read-only"):
        _run(data, tmp_path, "--experiment", "e", "--epochs", "1")
    assert not (tmp_path / "e" / "summary.csv").exists()


def test_disk_space_checked_before_training(data, tmp_path, monkeypatch):
    import shutil
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))
    with pytest.raises(SystemExit, match=r"Not enough free disk space.*MiB"):
        _run(data, tmp_path, "--experiment", "e", "--epochs", "1")
    assert not (tmp_path / "e" / "summary.csv").exists() and not (tmp_path / "e" / "last.state.pt").exists()


@pytest.mark.parametrize("stage", ["written", "renamed"])
def test_sigkill_during_save_keeps_previous_checkpoint(data, tmp_path, stage):
    """A real SIGKILL inside the epoch-2 save: the files on disk still load, and --resume finishes the run."""
    import _commit_faults
    cmd = _commit_faults.command(f"2:{stage}", "train", "--data-dir", data, "--output", str(tmp_path),
                                 "--experiment", "k", *TINY, "--epochs", "3")
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = tmp_path / "k" / _commit_faults.MARKER
    while not marker.exists():  # a hang is caught by pytest-timeout (pyproject.toml), not a deadline here
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    folder = tmp_path / "k"
    state = _state(folder)
    w = _weights(str(folder / "last.safetensors"))  # a complete file either way
    from safetensors import safe_open
    with safe_open(str(folder / "last.safetensors"), "pt") as f:
        assert f.metadata()["epoch"] == "1"  # the weights never run ahead of the state
    if stage == "written":  # nothing renamed: the epoch-1 checkpoint is intact and consistent
        assert state["epoch"] == 1 and all(torch.equal(w[k], state["model"][k]) for k in w)
    else:  # the state was renamed (epoch 2, self-contained); the weights are still epoch 1's
        assert state["epoch"] == 2
    os.remove(marker)
    main(["--data-dir", data, "--output", str(tmp_path), *TINY, "--epochs", "3", "--resume", str(folder)])
    final = _state(folder)
    assert final["epoch"] == 3
    w = _weights(str(folder / "last.safetensors"))
    assert all(torch.equal(w[k], final["model"][k]) for k in w)
