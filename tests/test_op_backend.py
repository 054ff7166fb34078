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
    monkeypatch.setattr(B.verify, "verified", lambda op, device, dtype: True)  # and verified there (tests/test_gpu_verification.py)
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


@pytest.fixture
def no_backend_set(monkeypatch):
    """Nothing set, no environment default; whatever a test sets is undone."""
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    monkeypatch.setattr(B, "_BACKEND_SET", None)


@pytest.mark.usefixtures("no_backend_set")
def test_set_backend_changes_every_op_and_none_restores(monkeypatch):
    from ttt_zoo.kernels import swiglu_ttt_torch
    cpu = torch.device("cpu")
    B.set_backend("torch_naive")
    assert get_op("vit3_swiglu_ttt", cpu) is swiglu_ttt_reference
    monkeypatch.setenv(B.ENV_VAR, "torch")  # set_backend wins over the environment variable
    assert resolve_backend(None, cpu) == "torch_naive"
    assert resolve_backend("torch", cpu) == "torch"  # an explicit argument wins over both
    B.set_backend(None)  # back to the environment variable, then auto
    assert resolve_backend(None, cpu) == "torch"
    monkeypatch.delenv(B.ENV_VAR)
    assert B.default_backend() == "auto" and get_op("vit3_swiglu_ttt", cpu) is swiglu_ttt_torch


@pytest.mark.usefixtures("no_backend_set")
def test_use_backend_restores_on_exit_on_error_and_nested():
    cpu = torch.device("cpu")
    with kernels.use_backend("torch_naive"):
        assert get_op("vit3_swiglu_ttt", cpu) is swiglu_ttt_reference
        with kernels.use_backend("torch"):
            assert resolve_backend(None, cpu) == "torch" and B.default_backend() == "torch"
        assert B.default_backend() == "torch_naive"
        with pytest.raises(RuntimeError, match="boom"):
            with kernels.use_backend("triton"):
                raise RuntimeError("boom")
        assert B.default_backend() == "torch_naive"
    assert B.default_backend() == "auto"
    B.set_backend("torch")
    with kernels.use_backend(None):  # None inside the block: the environment / auto
        assert B.default_backend() == "auto"
    assert B.default_backend() == "torch"


@pytest.mark.usefixtures("no_backend_set")
def test_bad_backend_name_is_one_clear_error():
    for bad in (lambda: B.set_backend("cudnn"), lambda: kernels.use_backend("cudnn").__enter__()):
        with pytest.raises(ValueError) as e:
            bad()
        assert str(e.value) == ("Unknown TTT backend 'cudnn'; choose one of ('auto', 'torch', 'torch_naive', "
                                "'triton') (set_backend).")
    assert B.default_backend() == "auto"  # a rejected name changes nothing


@pytest.fixture
def records(monkeypatch, tmp_path):
    """``records(*ops)``: GPU verification records for exactly these ops (their current kernel hashes)."""
    import json

    def write(*ops):
        path = tmp_path / "gpu_verified.json"
        path.write_text(json.dumps([dict(op=op, sha256=B.kernel_source_hash(op)) for op in ops]))
        monkeypatch.setenv(B.RECORDS_ENV, str(path))
        B.clear_verification_cache()

    yield write
    B.clear_verification_cache()


@pytest.mark.usefixtures("no_backend_set")
def test_each_op_is_decided_under_its_own_name(monkeypatch, records):
    # the three ViT3 ops share one kernel folder (one hash), yet a record for vit3_qkv_ttt counts for it alone
    monkeypatch.setattr(B, "HAS_TRITON", True)
    records("vit3_qkv_ttt")
    cuda = torch.device("cuda")
    assert resolve_backend(None, cuda, torch.bfloat16, 32, "vit3_qkv_ttt") == "triton"
    for op in ("vit3_swiglu_ttt", "vit3_dwconv_ttt", "vit3_variant_qkv_ttt", "ttt_linear"):
        assert resolve_backend(None, cuda, torch.bfloat16, 32, op) == "torch", op
    records("vit3_swiglu_ttt")
    assert resolve_backend(None, cuda, torch.bfloat16, 32, "vit3_swiglu_ttt") == "triton"
    assert resolve_backend(None, cuda, torch.bfloat16, 32, "vit3_qkv_ttt") == "torch"


@pytest.mark.usefixtures("no_backend_set")
def test_a_forced_backend_does_not_carry_to_the_next_call(monkeypatch, records):
    monkeypatch.setattr(B, "HAS_TRITON", True)
    records()  # nothing verified: auto runs PyTorch on CUDA
    cuda = torch.device("cuda")
    for op in TRITON_OPS:
        assert resolve_backend("triton", cuda, torch.float16, 16, op) == "triton"
        assert resolve_backend(None, cuda, torch.float16, 16, op) == "torch", op  # the next call decides anew
        with kernels.use_backend("triton"):
            assert resolve_backend(None, cuda, torch.float16, 16, op) == "triton"
        assert resolve_backend(None, cuda, torch.float16, 16, op) == "torch", op


def test_the_custom_ops_run_the_backend_they_are_given(monkeypatch):
    """The ViT3 mixer core's custom ops run the Triton kernels exactly when told (their last argument), forward
    and backward alike, whatever ran before; the kernels are spied on (stand-ins computing the PyTorch path)."""
    import types
    from ttt_zoo.kernels.vit3_ttt import ops as vit3_ops
    from ttt_zoo.kernels.vit3_ttt import qkv_ttt_op
    calls = []

    def spy(name, impl):
        return lambda *a: calls.append(name) or impl(*a)

    fake = types.SimpleNamespace(qkv_fused_fwd=spy("fused_fwd", vit3_ops._qkv_fwd_torch),
                                 qkv_fused_bwd=spy("fused_bwd", vit3_ops._qkv_bwd_torch))
    monkeypatch.setattr(vit3_ops, "_f", lambda: fake)
    heads, h, w, d = 2, 2, 3, 4
    c = heads * d
    x, weight, bias = (torch.randn(*s, requires_grad=True) for s in ((2, h * w, c), (3 * c + 3 * d, c), (3 * c + 3 * d,)))
    w1, w2, w3 = (torch.randn(*s) * 0.3 for s in ((1, heads, d, d), (1, heads, d, d), (d, 1, 3, 3)))
    outs, grads = {}, {}
    for triton in (True, False, True):
        calls.clear()
        out = qkv_ttt_op(x, weight, bias, w1, w2, w3, (h, w), heads, 0.5, True, triton=triton)
        grads[triton] = torch.autograd.grad(out.sum(), (x, weight, bias))
        outs[triton] = out.detach()
        assert calls == (["fused_fwd", "fused_bwd"] if triton else []), calls
    torch.testing.assert_close(outs[True], outs[False])
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b)


@pytest.mark.usefixtures("no_backend_set")
def test_set_backend_under_torch_compile():
    # dynamo guards on the setting: a compiled function follows set_backend without a reset
    q = torch.randn(1, 2, 5, 4)
    w = torch.randn(1, 2, 4, 4)
    fn = torch.compile(lambda q, w: kernels.swiglu_ttt(q, q, q, w, w, 0.5), backend="eager", fullgraph=False)
    torch.testing.assert_close(fn(q, w), swiglu_ttt_reference(q, q, q, w, w, 0.5))
    with kernels.use_backend("triton"):
        if B.triton_unsupported(q.device, q.dtype, 4, "vit3_swiglu_ttt") is not None:
            with pytest.raises(B.BackendError):
                fn(q, w)
    torch.testing.assert_close(fn(q, w), swiglu_ttt_reference(q, q, q, w, w, 0.5))


@pytest.mark.usefixtures("no_backend_set")
def test_bench_child_gets_the_backend_as_an_argument(monkeypatch, tmp_path, capsys):
    # ttt-zoo bench --backend: the spec (the child's argument) carries it, the child calls set_backend; no env var
    import json
    from ttt_zoo.bench import child, run
    cfg = run.BenchConfig(backends=("torch_naive",))
    config = run._configs(cfg)[0]
    spec = run._spec(cfg, config, 32, 32, "inference")
    assert spec["backend"] == "torch_naive" and B.ENV_VAR not in run._env(cfg)
    seen = []
    monkeypatch.setattr("ttt_zoo.bench.models.bench_model", lambda s: seen.append(B.default_backend()) or {})
    child.main("model", json.dumps(spec))
    assert seen == ["torch_naive"] and B.ENV_VAR not in __import__("os").environ
    # a --before tree whose child predates the argument would measure the default backend: one clear error instead
    (tmp_path / "ttt_zoo" / "bench").mkdir(parents=True)
    (tmp_path / "ttt_zoo" / "bench" / "child.py").write_text("import os\n")
    r = run._run_model_child("model", cfg, dict(config, src=str(tmp_path)), 32, 32, "infer")
    assert "predates passing the TTT backend" in r["error"]
