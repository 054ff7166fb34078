"""timm's ONNX export on every classifier code path, with both of torch's exporters (issue 38, item 4).

timm's ``onnx_export.py`` (in timm's repository, not in its sdist or wheel) builds the model with
``timm.create_model(name, exportable=True)`` and calls ``timm.utils.onnx.onnx_export`` (in the wheel); with
``--dynamic-size --check-forward`` it traces batch 1 at ``--img-size``, runs ``onnx.checker`` and compares
onnxruntime with PyTorch at that input (``--dynamo``: the dynamo exporter, else TorchScript's).  The same two calls
run here on every classifier code path (``test_registry_contract.CLASSIFIER_REPS``: one model per code path, from
the registry) with each exporter, with small widths (the script takes no model kwargs; the code path is the same)
and autograd left on, as timm's export does.  onnxruntime is also compared within 1e-4 (relative) at the traced
size and at batch 3 and a larger non-square size, which the script does not do: a graph that fixed the size (a
loop unrolled to the traced token count) fails there.
"""
import pytest
import timm
import torch

from test_registry_contract import CLASSIFIER_REPS, onnx_kwargs, rel_err, small_image_size

EXPORTERS = ("torchscript", "dynamo")


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


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", CLASSIFIER_REPS)
def test_timm_onnx_export(name, exporter, tmp_path):
    timm_onnx_export(name, tmp_path, dynamo=exporter == "dynamo")


# ----------------------------------------------- the TTT-Linear scan's export form (kernels/ttt_linear/export.py)
def _scan_inputs(n, mb=4, bsz=2, heads=2, d=6, separate_w0=False, same_qk=True):
    g = torch.Generator().manual_seed(n)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    k = r(bsz, heads, n, d) * 0.5
    q = k if same_qk else r(bsz, heads, n, d) * 0.5
    nw = 2 if separate_w0 else 1
    return (q, k, r(bsz, heads, n, d), torch.rand(bsz, heads, n, generator=g, dtype=torch.float64) * 0.2,
            r(mb).abs() * 0.5 + 0.5, r(nw, heads, d, d) * 0.1, r(nw, heads, 1, d) * 0.1, 1 + 0.1 * r(heads, d),
            0.1 * r(heads, d))


@pytest.mark.parametrize("ln_residual", [True, False])
@pytest.mark.parametrize("n", [3, 8, 13])
def test_export_form_is_the_reference(n, ln_residual):
    """The export form against the plain reference (float64): causal, and both directions with RoPE, shared and
    per-direction W0, q = k and q != k; token counts below, at and off the mini-batch multiple."""
    from ttt_zoo.kernels.ttt_linear import (ttt_linear_bidir_export, ttt_linear_bidir_naive, ttt_linear_export,
                                            ttt_linear_naive)
    for separate, same_qk in ((False, True), (True, False)):
        args = _scan_inputs(n, separate_w0=separate, same_qk=same_qk)
        bidir = (*args, 4, ln_residual, 10000.0)
        torch.testing.assert_close(ttt_linear_bidir_export(*bidir)[0], ttt_linear_bidir_naive(*bidir)[0],
                                   rtol=1e-10, atol=1e-10)
        if not separate:
            causal = (*args, 4, ln_residual)
            torch.testing.assert_close(ttt_linear_export(*causal)[0], ttt_linear_naive(*causal)[0],
                                       rtol=1e-10, atol=1e-10)


def test_traced_scan_holds_at_other_token_counts():
    """torch.jit.trace (TorchScript's exporter) of the ``torch`` backend takes the export form (``exporting()``)
    with autograd on, and the trace is right at other token counts and batches (its loop's trip count follows N;
    the chunked or the recomputing scan would have been unrolled to the traced N)."""
    from ttt_zoo.kernels import ttt_linear_bidir
    from ttt_zoo.kernels.ttt_linear import ttt_linear_bidir_naive
    args = _scan_inputs(10)
    params = tuple(t.clone().requires_grad_() for t in args[4:])  # tau, w0, b0, ln_w, ln_b: parameters, as in a model

    def scan(q, v, lr, *p):
        return ttt_linear_bidir(q, q, v, lr, *p, 4, True, 10000.0, backend="torch")[0]
    traced = torch.jit.trace(scan, (args[0], args[2], args[3], *params), check_trace=False)
    for n, bsz in ((10, 2), (3, 1), (23, 3)):
        q, _, v, lr, *_ = _scan_inputs(n, bsz=bsz)
        want = ttt_linear_bidir_naive(q, q, v, lr, *args[4:], 4, True, 10000.0)[0]
        torch.testing.assert_close(traced(q, v, lr, *params), want, rtol=1e-10, atol=1e-10)


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
