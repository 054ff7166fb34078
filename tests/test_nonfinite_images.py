"""Issue 36 items 5 and 7: a model whose outputs are NaN is an error in validate, predict, sample and bench (one
line naming where; nothing written), never a result; every JSON we write is valid JSON.  Images as users have
them: 16-bit and palette PNGs scaled correctly, EXIF orientation applied, every unreadable file named, --skip-bad."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from _train_data import make_tiny_digits

from ttt_zoo.cli import main

KW = dict(depth=1, embed_dim=16, num_heads=2, patch_size=4)
KW_ARGS = [f"{k}={v}" for k, v in KW.items()]


def cli(capsys, *argv):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_error(rc, err, *phrases):
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(p in lines[0] for p in phrases), err
    return lines[0]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import timm
    import ttt_zoo  # noqa: F401
    root = tmp_path_factory.mktemp("nonfinite")
    data = make_tiny_digits(str(root / "digits"), train_per_class=1, val_per_class=2)
    torch.manual_seed(0)
    model = timm.create_model("vit3_tiny", img_size=16, num_classes=10, **KW)
    save_file(model.state_dict(), str(root / "good.safetensors"))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["head.bias"][:] = float("nan")
    save_file(sd, str(root / "nan.safetensors"))
    return dict(root=root, data=data, good=str(root / "good.safetensors"), nan=str(root / "nan.safetensors"))


def _model_args(weights):
    return ["--model", "vit3_tiny", "--checkpoint", weights, "--model-kwargs", *KW_ARGS, "--img-size", "16",
            "--num-classes", "10", "-j", "0"]


# ----- 5. non-finite results -----

@pytest.fixture
def unchecked_weights(monkeypatch):
    """NaN weights are refused where they enter (tests/test_weight_checks.py); these tests check the second line of
    defence, the outputs, so the entry check is turned off for them."""
    import ttt_zoo.checkpoint
    monkeypatch.setattr(ttt_zoo.checkpoint, "check_finite", lambda *a, **k: None)


@pytest.mark.usefixtures("unchecked_weights")
def test_validate_refuses_nan_outputs(env, tmp_path, capsys):
    results = tmp_path / "r.json"
    rc, out, err = cli(capsys, "validate", "--data-dir", env["data"], "--split", "val", *_model_args(env["nan"]),
                       "--results-file", results)
    line = _one_error(rc, err, "has NaN for 20 of 20 images", "(first: ", ".png)")
    assert "top1" not in out and not results.exists(), line
    rc, out, err = cli(capsys, "validate", "--data-dir", env["data"], "--split", "val", *_model_args(env["good"]),
                       "--results-file", results)
    assert rc == 0, err
    json.loads(results.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


@pytest.mark.usefixtures("unchecked_weights")
def test_predict_refuses_nan_outputs(env, tmp_path, capsys):
    results = tmp_path / "p.json"
    rc, out, err = cli(capsys, "predict", os.path.join(env["data"], "val"), *_model_args(env["nan"]),
                       "--results-file", results)
    _one_error(rc, err, "has NaN for 20 of 20 images", "(first: ", ".png)")
    assert not results.exists() and out == ""
    rc, out, err = cli(capsys, "predict", os.path.join(env["data"], "val"), *_model_args(env["good"]),
                       "--results-file", results)
    assert rc == 0, err
    for text in (out, results.read_text()):  # strict JSON: no NaN / Infinity
        assert len(json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))) == 20


def test_json_writer_refuses_nan():
    from ttt_zoo.errors import UsageError
    from ttt_zoo.finite import json_dumps
    with pytest.raises(UsageError, match=r"not a finite number \(\[1\]\.prob = nan\)"):
        json_dumps([{"prob": 0.5}, {"prob": float("nan")}])
    assert json.loads(json_dumps({"a": [1.0, 2]})) == {"a": [1.0, 2]}


@pytest.mark.usefixtures("unchecked_weights")
def test_sample_refuses_nan_outputs(tmp_path, capsys):
    import timm
    import ttt_zoo  # noqa: F401
    model = timm.create_model("dit3_s_2", input_size=8, patch_size=2, hidden_size=32, depth=1, num_heads=2,
                              num_classes=4, in_chans=3)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["final_layer.linear.bias"][:] = float("nan")
    save_file(sd, str(tmp_path / "dit.safetensors"))
    out = tmp_path / "s.png"
    rc, _, err = cli(capsys, "sample", "--model", "dit3_s_2", "--checkpoint", tmp_path / "dit.safetensors",
                     "--model-kwargs", "patch_size=2", "hidden_size=32", "depth=1", "num_heads=2", "--steps", "2",
                     "--labels", "0", "1", "--out", out)
    _one_error(rc, err, "the samples of dit3_s_2 has NaN for 2 of 2 samples", "(first: sample 0, label 0)")
    assert not out.exists()


def test_bench_refuses_nan_outputs(tmp_path, monkeypatch, capsys):
    (tmp_path / "nan_peer_mod.py").write_text(
        "import torch, timm\n"
        "from timm.models import register_model\n"
        "class NanNet(torch.nn.Module):\n"
        "    def __init__(self, num_classes=10, **kw):\n"
        "        super().__init__()\n"
        "        self.num_classes = num_classes\n"
        "        self.fc = torch.nn.Linear(3, num_classes)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.mean((2, 3))) * float('nan')\n"
        "@register_model\n"
        "def nan_net_tiny(pretrained=False, **kw):\n"
        "    return NanNet(**kw)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, err = cli(capsys, "bench", "--import", "nan_peer_mod", "--model", "nan_net_tiny", "--device", "cpu",
                       "--img-size", "32", "--bench", "inference", "--num-warm-iter", "0", "--num-bench-iter", "1",
                       "--results-file", tmp_path / "b.json")
    assert rc == 1 and "NaN or infinite" in out and "1 configuration(s) failed" in err, (out, err)
    rows = json.loads((tmp_path / "b.json").read_text(), parse_constant=lambda c: pytest.fail(c))["results"]
    assert "infer_step_time" not in rows[0] and "NaN or infinite" in rows[0]["infer_error"]


# ----- 7. images as users have them -----

def _reference(h=24, w=16):
    """An 8-bit greyscale image with structure in both directions (h != w: a sideways image differs)."""
    y, x = np.mgrid[:h, :w]
    return ((x * 13 + y * y * 3) % 256).astype(np.uint8)


def _inputs(paths):
    """The tensors predict feeds the model (its dataset, the model's eval transform) for each file."""
    import timm
    from timm.data import create_transform, resolve_data_config
    from ttt_zoo.cli.predict import _Images
    model = timm.create_model("vit3_tiny", img_size=16, num_classes=10, **KW)
    cfg = resolve_data_config({}, model=model, use_test_size=True)
    ds = _Images(paths, create_transform(**cfg), cfg["input_size"])
    return [ds[i] for i in range(len(paths))]


def test_16_bit_and_palette_pngs_are_scaled_like_their_8_bit_image(tmp_path):
    ref = _reference()
    Image.fromarray(ref).convert("RGB").save(tmp_path / "ref.png")
    sixteen = Image.fromarray(ref.astype(np.uint16) * 257)  # the same picture in 16 bits
    assert sixteen.mode == "I;16"
    sixteen.save(tmp_path / "sixteen.png")
    Image.fromarray(ref).convert("RGB").quantize(256).save(tmp_path / "palette.png")
    assert Image.open(tmp_path / "sixteen.png").mode in ("I;16", "I")
    assert Image.open(tmp_path / "palette.png").mode == "P"
    from ttt_zoo.images import open_rgb
    assert np.array_equal(np.asarray(open_rgb(str(tmp_path / "sixteen.png"))),
                          np.asarray(open_rgb(str(tmp_path / "ref.png"))))
    (x_ref, e0), (x16, e1), (xp, e2) = _inputs([str(tmp_path / n) for n in ("ref.png", "sixteen.png", "palette.png")])
    assert e0 == e1 == e2 == ""
    assert torch.equal(x16, x_ref)
    assert torch.allclose(xp, x_ref, atol=0.05)  # a 256-colour palette of a greyscale image: at most one level off
    clipped = np.asarray(Image.open(tmp_path / "sixteen.png").convert("RGB"))  # what PIL alone does: near-white
    assert (clipped == 255).mean() > 0.9


def test_predict_of_a_16_bit_png_equals_the_8_bit_one(env, tmp_path, capsys):
    ref = _reference(16, 16)
    Image.fromarray(ref).convert("RGB").save(tmp_path / "eight.png")
    Image.fromarray(ref.astype(np.uint16) * 257).save(tmp_path / "sixteen.png")
    rc, out, err = cli(capsys, "predict", tmp_path / "eight.png", tmp_path / "sixteen.png", *_model_args(env["good"]),
                       "--topk", "3", "--label-type", "index")
    assert rc == 0, err
    got = json.loads(out)
    assert got["eight.png"] == got["sixteen.png"]


def test_exif_orientation_is_applied(tmp_path):
    up = Image.fromarray(_reference()).convert("RGB")
    up.save(tmp_path / "upright.jpg", quality=100, subsampling=0)
    sideways = up.transpose(Image.Transpose.ROTATE_90)  # stored sideways, as a phone does, with the tag to undo it
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 clockwise to view
    sideways.save(tmp_path / "rotated.jpg", quality=100, subsampling=0, exif=exif)
    from ttt_zoo.images import open_rgb
    a, b = (np.asarray(open_rgb(str(tmp_path / n)), dtype=np.float32) for n in ("upright.jpg", "rotated.jpg"))
    assert a.shape == b.shape == (24, 16, 3) and np.abs(a - b).mean() < 2  # JPEG noise only
    (x_up, _), (x_rot, _) = _inputs([str(tmp_path / "upright.jpg"), str(tmp_path / "rotated.jpg")])
    sideways.save(tmp_path / "sideways.png")  # the stored pixels without the tag
    (x_raw, _), = _inputs([str(tmp_path / "sideways.png")])
    assert (x_up - x_rot).abs().mean() < 0.05 < (x_up - x_raw).abs().mean()  # the tag ignored: another input


def test_predict_names_every_bad_file_and_skip_bad_writes_the_rest(env, tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(_reference(16, 16)).convert("RGB").save(folder / "good.png")
    (folder / "bad1.png").write_bytes(b"not a png")
    (folder / "bad2.jpg").write_bytes(b"\xff\xd8\xff truncated")
    results = tmp_path / "r.csv"
    rc, out, err = cli(capsys, "predict", folder, *_model_args(env["good"]), "--results-file", results)
    line = _one_error(rc, err, "cannot read 2 of 3 image(s)", "bad1.png", "bad2.jpg", "--skip-bad")
    assert "good.png" not in line and not results.exists()
    rc, out, err = cli(capsys, "predict", folder, *_model_args(env["good"]), "--results-file", results,
                       "--skip-bad", "--label-type", "index")
    assert rc == 0, err
    assert list(json.loads(out)) == ["good.png"] and "skipped 2 unreadable image(s)" in err
    assert results.read_text().splitlines()[1].startswith("good.png,")


@pytest.mark.usefixtures("unchecked_weights")
def test_push_refuses_a_folder_with_nan_outputs(env, tmp_path, capsys):
    hub = tmp_path / "hub"
    rc, _, err = cli(capsys, "convert", env["nan"], "--model", "vit3_tiny.nan", "--model-kwargs", *KW_ARGS,
                     "img_size=16", "num_classes=10", "--out", hub, "--no-flops")
    assert rc == 0, err
    rc, out, err = cli(capsys, "push", hub, "--dry-run", "--no-source-check")
    _one_error(rc, err, f"the output of {hub} has NaN for 2 of 2 example inputs")
