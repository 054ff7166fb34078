"""``ttt-zoo validate``: top-1 against an independent computation (PIL + numpy preprocessing, our own argmax) and
against checkpoints whose accuracy is known in advance; folders of checkpoints, EMA weights, results files, errors."""

import csv
import json
import os

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

import ttt_zoo  # noqa: F401
from ttt_zoo.checkpoint import CheckpointError
from ttt_zoo.cli import main
from ttt_zoo.train.validate import find_checkpoints, validate

MODEL, KW = "vit3_tiny", dict(depth=1)
COUNTS = (5, 3, 2)  # val images per class: a constant prediction of class c scores COUNTS[c] / 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    rng = np.random.default_rng(0)
    for c, n in enumerate(COUNTS):
        os.makedirs(root / "val" / str(c))
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / "val" / str(c) / f"{i}.png")
    return str(root)


def _model(seed=0):
    torch.manual_seed(seed)
    return timm.create_model(MODEL, num_classes=3, img_size=32, **KW).eval()


def _independent_top1(model, folder):
    """PIL -> [0, 1] -> the model's mean/std, argmax; no timm data code."""
    mean = torch.tensor(model.pretrained_cfg["mean"]).view(3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(3, 1, 1)
    xs, ys = [], []
    for c in sorted(os.listdir(os.path.join(folder, "val"))):
        for f in sorted(os.listdir(os.path.join(folder, "val", c))):
            a = np.asarray(Image.open(os.path.join(folder, "val", c, f)).convert("RGB"), dtype=np.float32) / 255
            xs.append((torch.from_numpy(a).permute(2, 0, 1) - mean) / std)
            ys.append(int(c))
    with torch.no_grad():
        pred = model(torch.stack(xs)).argmax(-1)
    return 100.0 * (pred == torch.tensor(ys)).float().mean().item(), pred


def _biased(cls, seed=0):
    """A state dict whose head ignores the features and always answers ``cls``."""
    sd = {k: v.clone() for k, v in _model(seed).state_dict().items()}
    sd["head.weight"].zero_()
    sd["head.bias"].copy_(torch.nn.functional.one_hot(torch.tensor(cls), 3).float() * 5)
    return sd


def _run(folder, ckpt, **kw):
    return validate(MODEL, folder, checkpoint=ckpt, img_size=32, crop_pct=1.0, batch_size=4, workers=0,
                    device="cpu", model_kwargs=KW, **kw)


def test_top1_matches_independent_computation(folder, tmp_path):
    trained = _model(seed=123)
    ckpt = str(tmp_path / "w.safetensors")
    save_file(trained.state_dict(), ckpt)
    want, pred = _independent_top1(trained, folder)
    _, pred_fresh = _independent_top1(_model(seed=0), folder)
    assert not torch.equal(pred, pred_fresh)  # the checkpoint's weights decide the answer
    (row,) = _run(folder, ckpt)
    assert row["top1"] == pytest.approx(want, abs=1e-6)
    assert row["top1_err"] == pytest.approx(100 - want, abs=1e-6)
    assert row["top5"] == pytest.approx(100.0)  # top-k with k = min(5, 3 classes)
    assert row["param_count"] == pytest.approx(sum(p.numel() for p in trained.parameters()) / 1e6, abs=1e-4)
    assert (row["img_size"], row["crop_pct"], row["model"]) == (32, 1.0, MODEL)


def test_folder_ema_and_results_files(folder, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_file(_biased(1), str(run / "last.safetensors"))                  # always class 1: 3/10
    save_file(_biased(2), str(run / "last_ema.safetensors"))              # EMA: always class 2: 2/10
    torch.save({"model": _biased(1), "model_ema": _biased(2)}, str(run / "last.state.pt"))  # same as last.*
    torch.save({"model": _biased(0), "model_ema": _biased(2)}, str(run / "old.pth"))  # class 0: 5/10
    assert [os.path.basename(p) for p in find_checkpoints(str(run))] == ["last.safetensors", "old.pth"]
    rows = _run(folder, str(run))
    assert [(os.path.basename(r["checkpoint"]), r["top1"]) for r in rows] == [("last.safetensors", 30.0),
                                                                               ("old.pth", 50.0)]
    assert [r["top1"] for r in _run(folder, str(run), use_ema=True)] == [20.0, 20.0]

    out_csv, out_json = str(tmp_path / "r.csv"), str(tmp_path / "r.json")
    base = ["validate", "--data-dir", folder, "--model", MODEL, "--model-kwargs", "depth=1", "--img-size", "32",
            "--crop-pct", "1.0", "-b", "4", "-j", "0", "--device", "cpu", "--checkpoint", str(run)]
    assert main(base + ["--results-file", out_csv]) == 0
    with open(out_csv) as f:
        got = list(csv.DictReader(f))
    assert list(got[0])[:8] == ["model", "top1", "top1_err", "top5", "top5_err", "param_count", "img_size", "crop_pct"]
    assert [float(r["top1"]) for r in got] == [30.0, 50.0] and float(got[0]["top1_err"]) == 70.0
    assert main(base + ["--use-ema", "--results-file", out_json]) == 0
    assert [r["top1"] for r in json.load(open(out_json))] == [20.0, 20.0]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_clear_errors(folder, tmp_path):
    ckpt = str(tmp_path / "w.safetensors")
    save_file(_model().state_dict(), ckpt)
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        _run(str(tmp_path / "nope"), ckpt)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _run(folder, str(tmp_path / "missing.safetensors"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="No checkpoint files"):
        _run(folder, str(tmp_path / "empty"))
    # a checkpoint of another architecture (wider, deeper): named keys and shapes, not a traceback
    torch.manual_seed(0)
    other = timm.create_model(MODEL, num_classes=3, img_size=32, depth=2, embed_dim=96, num_heads=3)
    save_file(other.state_dict(), str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="does not fit model.*shape mismatches.*unexpected keys"):
        _run(folder, str(tmp_path / "other.safetensors"))
    # a 1000-class checkpoint on a 3-class folder: says which num_classes to use
    save_file(timm.create_model(MODEL, img_size=32, **KW).state_dict(), str(tmp_path / "in1k.safetensors"))
    with pytest.raises(CheckpointError, match="num_classes=1000"):
        _run(folder, str(tmp_path / "in1k.safetensors"))
    with pytest.raises(CheckpointError, match="no EMA weights"):
        _run(folder, ckpt, use_ema=True)
    with pytest.raises(SystemExit, match=r"\.csv or \.json"):
        main(["validate", "--data-dir", folder, "--model", MODEL, "--checkpoint", ckpt, "--results-file", "r.txt"])
    with pytest.raises(SystemExit, match="does not fit model"):
        main(["validate", "--data-dir", folder, "--model", MODEL, "--model-kwargs", "depth=1", "--img-size", "32",
              "-j", "0", "--checkpoint", str(tmp_path / "other.safetensors")])


def test_progress_lines_past_the_delay_none_before(folder, tmp_path, capsys, monkeypatch):
    """A pass longer than the progress delay prints lines to stderr (first batch, last batch: 3 batches of 4) with
    the ETA, img/s and the running top-1; a shorter one prints none.  The delay is set, not waited for."""
    import ttt_zoo.progress
    ckpt = str(tmp_path / "w.safetensors")
    save_file(_biased(1), ckpt)  # always class 1: top-1 3/10
    argv = ["validate", "--data-dir", folder, "--model", MODEL, "--model-kwargs", "depth=1", "--img-size", "32",
            "--crop-pct", "1.0", "-b", "4", "-j", "0", "--device", "cpu", "--checkpoint", ckpt]
    monkeypatch.setattr(ttt_zoo.progress, "DEFAULT_DELAY", 0.0)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("validate ")]
    assert [line.split(" eta ")[0] for line in lines] == ["validate w.safetensors [1/3]", "validate w.safetensors [3/3]"]
    assert all(" img/s " in line for line in lines) and lines[-1].endswith(" top1 30.00"), err
    assert "top1 30.000" in out  # the result itself stays on stdout
    monkeypatch.setattr(ttt_zoo.progress, "DEFAULT_DELAY", 1e9)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "[1/3]" not in err and "top1 30.000" in out
