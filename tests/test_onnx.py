"""ONNX export (torch's dynamo exporter) through the CLI: a checkpoint's weights exported at a non-square size,
onnxruntime against PyTorch within 1e-4 (relative to the output's scale) at another size and batch, the CLI's
errors, and the refusal of a graph whose tracing fixed a dynamic size.  Every classifier code path's export (small
widths, onnxruntime at the traced and at a non-square size; Vision-TTT's mini-batch scan exports as one ONNX ``Scan``
loop, so its token count stays dynamic too) is a column of tests/test_registry_contract.py."""

import os

import pytest
import torch

import ttt_zoo
from ttt_zoo.cli import main

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def _rel_err(out, ref) -> float:
    return float((torch.as_tensor(out) - ref).abs().max() / ref.abs().max())


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
    assert "is a diffusion model" in capsys.readouterr().err  # an image model is needed
    assert main(["export", "--model", "t5_tiny", "--model-args", '{"depth": 1}', "--img-size", "100", "128",
                 "--out", out]) == 2
    assert "multiples of 16" in capsys.readouterr().err
    assert main(["export", "--model", "t5_tiny", "--checkpoint", str(tmp_path / "missing.pth"), "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert os.path.getsize(out) == before


class _FixesItsSize(torch.nn.Module):
    """A classifier whose forward turns the traced height into a Python int (the fault once in the ViT3 variants'
    op: their ONNX graphs ran at the traced size only, and the exporter said nothing)."""
    patch_size = 16

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):
        rows = int(x.shape[2]) // 16
        return self.head(x.reshape(x.shape[0], 3, rows, -1).mean((2, 3)))


def test_export_refuses_a_graph_that_fixed_a_dynamic_size(tmp_path):
    from ttt_zoo.export import ExportError, export_onnx
    out = str(tmp_path / "fixed.onnx")
    with pytest.raises(ExportError, match=r"fixed a dynamic size .*nothing was written"):
        export_onnx(_FixesItsSize(), out, (32, 48))
    assert not os.path.exists(out)
