"""timm's ONNX export on every classifier code path, with both of torch's exporters (issue 38, item 4).

timm's ``onnx_export.py`` (in timm's repository, not in its sdist or wheel) builds the model with
``timm.create_model(name, exportable=True)`` and calls ``timm.utils.onnx.onnx_export`` (in the wheel); with
``--dynamic-size --check-forward`` it traces batch 1 at ``--img-size``, runs ``onnx.checker`` and compares
onnxruntime with PyTorch at that input (``--dynamo``: the dynamo exporter, else TorchScript's).  The same two calls
run here, with small widths (the script takes no model kwargs; the code path is the same), and onnxruntime is
also compared within 1e-4 (relative) at the traced size and at batch 3 and a larger non-square size, which
the script does not do (a traced graph that fixed the size fails there).  This file runs TorchScript's exporter;
the dynamo exporter's per-code-path test stays ``tests/test_registry_contract.py::test_onnx_export``
(``ttt_zoo.export``, without autograd).  ``timm_onnx_export(name, tmp_path, dynamo=True)`` passed on 11 of the 14
code paths by hand; with autograd on (timm's export leaves it on) ``visionttt_h_tiny_la`` failed after 15 minutes
(experiments/results/timm_onnx_export.md).
"""
import pytest
import timm
import torch

from test_registry_contract import CLASSIFIER_REPS, onnx_kwargs, rel_err, small_image_size

# Vision-TTT's TTT-Linear scan runs an autograd.Function and a Python loop over mini-batches; TorchScript's tracer
# stops in it (and a traced loop would fix the token count): not done yet.
TORCHSCRIPT_NOT_YET = {n for n in CLASSIFIER_REPS if n.startswith("visionttt")}


def timm_onnx_export(name: str, tmp_path, dynamo: bool) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from timm.utils.onnx import onnx_export

    from ttt_zoo.export import input_multiple
    torch.manual_seed(0)
    model = timm.create_model(name, exportable=True, in_chans=3, **onnx_kwargs(name))
    h, w = small_image_size(model, name)
    path = str(tmp_path / f"{name}.onnx")
    # onnx_export.py OUT --model NAME --img-size h --dynamic-size --check-forward [--dynamo]
    onnx_export(model, path, dynamic_size=True, check_forward=True, use_dynamo=dynamo, input_size=(3, h, h),
                batch_size=1)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    mult = input_multiple(model)
    for b, hw in ((1, (h, h)), (3, (h + mult, w + mult))):
        x = torch.randn(b, 3, *hw)
        with torch.no_grad():
            ref = model.eval()(x)
        out = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        assert out.shape == tuple(ref.shape) and rel_err(out, ref) < 1e-4, (b, hw, rel_err(out, ref))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(
    strict=True, reason="TorchScript's tracer stops in the TTT-Linear scan")) if n in TORCHSCRIPT_NOT_YET else n
    for n in CLASSIFIER_REPS])
def test_timm_onnx_export_torchscript(name, tmp_path):
    timm_onnx_export(name, tmp_path, dynamo=False)


def test_exportable_builds_keep_the_mlp_activations():
    """``exportable=True`` builds MLPs without the recomputing autograd.Function (TorchScript's exporter cannot
    trace one); the default build keeps it."""
    from ttt_zoo.kernels.backend import exporting
    kw = onnx_kwargs("vit3_tiny")
    default, exportable = timm.create_model("vit3_tiny", **kw), timm.create_model("vit3_tiny", exportable=True, **kw)
    assert not exporting()  # the flag holds while timm builds, not after
    flags = [[m.recompute_act for m in model.modules() if hasattr(m, "recompute_act")]
             for model in (default, exportable)]
    assert flags[0] and all(flags[0]) and not any(flags[1]) and len(flags[0]) == len(flags[1])
