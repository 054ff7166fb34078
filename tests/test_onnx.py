"""ONNX export (torch's dynamo exporter) of every classifier family: onnxruntime against PyTorch within 1e-4
(relative to the output's scale) at 224 and at a non-square size, other batch sizes than the traced one, and the
CLI's errors.  Vision-TTT's mini-batch scan exports as one ONNX ``Scan`` (a loop op), so its token count stays
dynamic too.  Reduced depth keeps the exports short; the families with the slowest traces are marked slow."""

import os

import pytest
import torch

import ttt_zoo
from ttt_zoo.cli import main

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

# one block (per stage): the same code as the full models, traced in seconds
SMALL = {"vit3": dict(depth=1), "t5": dict(depth=1), "t5_plus": dict(depth=1), "visionttt": dict(depth=1),
         "hvit3": dict(depths=(1, 1, 1, 1)), "visionttt_h": dict(depths=(1, 1, 1, 1))}
FAST = ("vit3", "t5_plus")  # in CI; the others are `slow` (minutes each on two cores)


def _marks(f):
    return pytest.param(f, marks=[] if f in FAST else [pytest.mark.slow])
FAMILIES = ttt_zoo.list_zoo_families()


def test_every_classifier_family_covered():
    assert sorted(SMALL) == sorted(FAMILIES), "add the new family to SMALL (reduced-depth kwargs)"


def _rel_err(out, ref) -> float:
    return float((torch.as_tensor(out) - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("family", [_marks(f) for f in SMALL])
def test_onnxruntime_matches_pytorch(family, tmp_path):
    name = FAMILIES[family]
    model = ttt_zoo.create_model(name, **SMALL[family]).eval()
    path = str(tmp_path / f"{name}.onnx")
    from ttt_zoo.export import export_onnx
    mult, _ = export_onnx(model, path, (224, 224))
    onnx.checker.check_model(path)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    h2, w2 = 5 * mult, 8 * mult  # non-square, not the traced size
    for b, (h, w) in ((1, (224, 224)), (3, (h2, w2))):
        x = torch.randn(b, 3, h, w)
        with torch.no_grad():
            ref = model(x)
        out = sess.run(None, {"image": x.numpy()})[0]
        assert out.shape == tuple(ref.shape)
        assert _rel_err(out, ref) < 1e-4, (name, b, h, w, _rel_err(out, ref))


def test_cli_export_and_errors(tmp_path, capsys):
    from safetensors.torch import save_file
    model = ttt_zoo.create_model("t5_tiny", depth=1).eval()
    ckpt = str(tmp_path / "t5.safetensors")
    save_file(model.state_dict(), ckpt)
    out = str(tmp_path / "m.onnx")
    assert main(["export", "--format", "onnx", "--model", "t5_tiny", "--model-kwargs", "depth=1",
                 "--checkpoint", ckpt, "--img-size", "96", "128", "--out", out]) == 0
    assert "multiples of 16" in capsys.readouterr().out
    sess = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    x = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        ref = model(x)
    assert _rel_err(sess.run(None, {"image": x.numpy()})[0], ref) < 1e-4  # the checkpoint's weights were exported
    # bad requests: a clear error, exit status 2, the existing file kept
    before = os.path.getsize(out)
    assert main(["export", "--model", "dit_s_2", "--model-args", '{"depth": 1}', "--out", out]) == 2
    assert "classifier" in capsys.readouterr().err
    assert main(["export", "--model", "t5_tiny", "--model-args", '{"depth": 1}', "--img-size", "100", "128",
                 "--out", out]) == 2
    assert "multiples of 16" in capsys.readouterr().err
    assert main(["export", "--model", "t5_tiny", "--checkpoint", str(tmp_path / "missing.pth"), "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert os.path.getsize(out) == before
