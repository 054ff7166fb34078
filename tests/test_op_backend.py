"""The one backend decision (``kernels/backend.py``): the same values and the same errors for every op.

CPU/meta use the PyTorch path under ``auto``; a forced backend is honoured or explained with one error; the
``TTT_ZOO_BACKEND`` default is read in one place; every registered op and every TTT layer goes through it.
"""
import importlib.util

import pytest
import torch

from _ops import triton_test
from ttt_zoo import kernels
from ttt_zoo.kernels import backend as B
from ttt_zoo.kernels import get_op, resolve_backend, swiglu_ttt_reference


def test_cpu_and_meta_use_pytorch_paths():
    from ttt_zoo.kernels import swiglu_ttt_torch
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    assert get_op("vit3_swiglu_ttt", torch.device("meta")) is swiglu_ttt_torch
    assert get_op("vit3_swiglu_ttt", torch.device("cpu"), "torch_naive") is swiglu_ttt_reference


def test_env_and_argument_force_backend(monkeypatch):
    monkeypatch.setenv("TTT_ZOO_BACKEND", "torch")
    assert resolve_backend(None, torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="Unknown TTT backend 'cudnn'.*TTT_ZOO_BACKEND"):
        resolve_backend("cudnn", torch.device("cpu"))
    with pytest.raises(KeyError, match="Unknown TTT op"):
        get_op("nope", torch.device("cpu"))


def test_available_ops_lists_vit3_ops():
    ops = kernels.available_ops()
    assert {"vit3_swiglu_ttt", "vit3_dwconv_ttt"} <= set(ops)
    assert all(v["torch"] for v in ops.values())


ALL_OPS = sorted(kernels.available_ops())
# ops that are GEMMs only (cuBLAS already runs them well), so they deliberately have no Triton kernel
PYTORCH_ONLY = {"last_layer_ttt"}
TRITON_OPS = [op for op in ALL_OPS if op not in PYTORCH_ONLY]


def _fake_cuda(monkeypatch):
    """Pretend the kernels can run on CUDA (Triton installed), without a GPU: the decision only reads metadata."""
    monkeypatch.setattr(B, "HAS_TRITON", True)
    monkeypatch.setattr(B, "gpu_verified", lambda op: True)  # and verified there (tests/test_gpu_verification.py)
    return torch.device("cuda")


@pytest.mark.parametrize("op", ALL_OPS)
def test_every_op_has_every_backend(op):
    impls = kernels.available_ops()[op]
    assert impls == {"torch": True, "torch_naive": True, "triton": op not in PYTORCH_ONLY}, op
    assert get_op(op, torch.device("cpu"), "torch") is not get_op(op, torch.device("cpu"), "torch_naive")


@pytest.mark.parametrize("op", sorted(PYTORCH_ONLY))
def test_pytorch_only_ops_explain_a_forced_triton(op, monkeypatch):
    cuda = _fake_cuda(monkeypatch)
    assert resolve_backend("auto", cuda, torch.float16, 32, op) == "torch"
    with pytest.raises(B.BackendError, match=f"op '{op}' has no Triton kernel.*backend='torch'"):
        resolve_backend("triton", cuda, torch.float32, 16, op)


@pytest.mark.parametrize("op", TRITON_OPS)
def test_auto_picks_triton_on_cuda_and_falls_back_consistently(op, monkeypatch):
    cuda = _fake_cuda(monkeypatch)
    assert resolve_backend("auto", cuda, torch.float16, 32, op) == "triton"
    assert resolve_backend(None, cuda, torch.float32, 32, op) == "triton"
    assert resolve_backend("auto", cuda, torch.float64, 32, op) == "torch"   # float64: no Triton kernels
    assert resolve_backend("auto", torch.device("cpu"), torch.float32, 32, op) == "torch"
    assert resolve_backend("auto", torch.device("meta"), torch.float32, 32, op) == "torch"
    monkeypatch.setattr(B, "HAS_TRITON", False)
    assert resolve_backend("auto", cuda, torch.float32, 32, op) == "torch"
    for name in ("torch", "torch_naive"):  # the PyTorch paths run anywhere, any dtype
        assert resolve_backend(name, cuda, torch.float64, 512, op) == name


@pytest.mark.parametrize("op", TRITON_OPS)
def test_forced_triton_raises_the_same_error_everywhere(op, monkeypatch):
    cuda = _fake_cuda(monkeypatch)
    with pytest.raises(B.BackendError, match=r"backend='triton' cannot run op .*float64.*backend='auto'"):
        resolve_backend("triton", cuda, torch.float64, 16, op)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(B.BackendError, match="CPU.*TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"), torch.float32, 16, op)
    monkeypatch.setenv("TTT_ZOO_BACKEND", "triton")  # the environment default forces the same way
    with pytest.raises(B.BackendError, match="TRITON_INTERPRET=1"):
        get_op(op, torch.device("cpu"), None, torch.float32, 16)
    monkeypatch.setattr(B, "HAS_TRITON", False)
    with pytest.raises(B.BackendError, match="Triton is not installed"):
        resolve_backend("triton", cuda, torch.float32, 16, op)


def test_head_dim_limit(monkeypatch):
    cuda = _fake_cuda(monkeypatch)
    assert resolve_backend("auto", cuda, torch.float32, 72, "ttt_linear_bidir") == "torch"
    assert resolve_backend("auto", cuda, torch.float32, 64, "ttt_linear_bidir") == "triton"
    with pytest.raises(B.BackendError, match="head dim 72 is above the kernel's limit of 64"):
        resolve_backend("triton", cuda, torch.float32, 72, "ttt_linear_bidir")
    assert resolve_backend("triton", cuda, torch.float32, 72, "vit3_swiglu_ttt") == "triton"  # column blocks


def test_wrappers_raise_when_forced_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 5, 4)
    w = torch.randn(1, 2, 4, 4)
    for call in (lambda: kernels.swiglu_ttt(q, q, q, w, w, 0.5, backend="triton"),
                 lambda: kernels.t5_swiglu_ttt(q, q, q, w, w, w, 0.5, backend="triton"),
                 lambda: kernels.mlp_ttt(q, q, q, w, w, 0.5, backend="triton"),
                 lambda: kernels.key_instance_norm(q[0], 1.0, backend="triton")):
        with pytest.raises(B.BackendError, match="TRITON_INTERPRET=1"):
            call()


@pytest.mark.usefixtures("kernel_device")
@triton_test
def test_forced_float64_raises_through_the_wrappers():
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    w = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    for call in (lambda: kernels.swiglu_ttt(q, q, q, w, w, 0.5, backend="triton"),
                 lambda: kernels.t5_swiglu_ttt(q, q, q, w, w, w, 0.5, backend="triton"),
                 lambda: kernels.key_instance_norm(q[0], 1.0, backend="triton")):
        with pytest.raises(B.BackendError, match="float64"):
            call()
    torch.testing.assert_close(kernels.swiglu_ttt(q, q, q, w, w, 0.5, backend="auto"),
                               swiglu_ttt_reference(q, q, q, w, w, 0.5))


def test_one_decision_point():
    # the environment variable is read in backend.py only, and no op folder decides on its own
    import pathlib
    root = pathlib.Path(kernels.__file__).parent
    layers = pathlib.Path(importlib.util.find_spec("ttt_zoo.layers").origin).parent
    for f in list(root.rglob("*.py")) + list(layers.glob("*.py")):
        text = f.read_text()
        if f.name != "backend.py":
            assert "TTT_ZOO_BACKEND\")" not in text and "TRITON_INTERPRET\")" not in text, f
            assert "find_spec(\"triton\")" not in text, f
        assert "na_backend" not in text, f


def test_bare_kernels_import_is_the_one_package():
    """From a source checkout's root (on sys.path under ``python -m pytest``), transformers imports any package named
    ``kernels`` to read its version.  That import must give ``ttt_zoo.kernels`` itself: a second copy registered the
    ``ttt_zoo::*`` custom ops again, so the ops ran that copy's kernel modules (the Triton spies of
    tests/test_op_inner_mlp.py then saw no call whenever a diffusers test file was collected first)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import importlib, sys; sys.path.insert(0, sys.argv[1]); import ttt_zoo; "
            "from transformers.utils import import_utils as u; u._is_package_available('kernels', True); "
            "import kernels; dup = sorted(m for m in sys.modules if m.startswith('kernels.')); "
            "print(kernels is ttt_zoo.kernels, dup)")
    r = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, cwd=root,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "True []", r.stdout
