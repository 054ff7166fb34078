"""The local kernel check (``kernels/verify.py``) and ``ttt-zoo kernels``.

``auto`` on CUDA runs an op's kernel where a repository record matches, else where the check made on this machine
(Triton against PyTorch, forward and backward, then timed) chose it; the result is cached per device name, torch and
Triton versions, kernel source hash and dtype.  The kernels themselves run on the CPU in the Triton interpreter (tests
marked ``triton``); the cache and compile/export tests stand the paths in (no kernel runs) on a fake CUDA device, whose
decision never initialises CUDA.
"""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from _ops import DEV, triton_test
from ttt_zoo.kernels import available_ops
from ttt_zoo.kernels import backend as B
from ttt_zoo.kernels import verify as V

ROOT = Path(__file__).resolve().parent.parent
KERNEL_OPS = sorted(op for op, paths in available_ops().items() if paths["triton"])
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
KERNEL_DEVICE = torch.device(DEV)  # where the kernels run here: a GPU, else the CPU in the interpreter
OP = "key_instance_norm"  # the quickest kernel in the interpreter


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    """An empty cache folder, no repository record, no forced backend, fresh per-process caches."""
    monkeypatch.setenv(V.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(V.RECORDS_ENV, str(tmp_path / "no_records.json"))
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    V.clear_verification_cache()
    yield
    V.clear_verification_cache()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled (a kernel whose backward is wrong by ``scale - 1``)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def _perturb(monkeypatch, op, forward=1.0, backward=1.0):
    """Replace ``op``'s registered Triton path by one whose output / gradients are off by a relative amount."""
    right = B._OPS[op]["triton"]

    def wrong(*args):
        return _ScaleGrad.apply(right(*args) * forward, backward)
    wrong.__module__ = right.__module__  # still the op's kernel (same source hash)
    monkeypatch.setitem(B._OPS[op], "triton", wrong)


def test_every_kernel_op_has_check_cases_within_its_limits():
    assert sorted(V.CASES) == KERNEL_OPS  # a new kernel without cases fails here (and its check fails)
    for op in KERNEL_OPS:
        limit = B.MAX_HEAD_DIM.get(op)
        for device in (CPU, CUDA):
            shapes = V.case_shapes(op, device)
            assert shapes and all(limit is None or s[V.HEAD_DIM_AT.get(op, -1)] <= limit for s in shapes), op
    maps = {"vit3_dwconv_ttt", "vit3_qkv_ttt", "vit3_variant_qkv_ttt"}  # (.., H, W, ..): N = H W
    for op in KERNEL_OPS:
        tokens = [s[2] * s[3] if op in maps else s[1] if op in ("key_instance_norm", "adaln_modulate", "mlp_gelu") else s[2]
                  for s in V.case_shapes(op, CUDA)]
        assert max(tokens) >= 4096 and any(n % 2 for n in tokens), (op, tokens)  # a long sequence, an odd size


@triton_test
def test_a_correct_kernel_passes_its_check():
    entry = V.check_op(OP, KERNEL_DEVICE, timing=False)
    assert entry["passed"] and entry["error"] <= V.TOL[torch.float32], entry
    assert entry["choice"] == "torch" and "not timed" in entry["why"]  # untimed: PyTorch
    assert V.cache_entry(OP, KERNEL_DEVICE, torch.float32) == entry


@triton_test
def test_the_dot_loss_scan_is_checked_as_its_own_op(monkeypatch):
    """``linear_attention_bidir`` (the LA forms' scan: the TTT-Linear kernels with the dot loss) is checked on its
    own inputs, as the layer calls it (logits, tau offsets), and a gradient 1% off fails its check."""
    op = "linear_attention_bidir"
    *_, lr_scale, tau_offset = V.case_inputs(op, V.case_shapes(op, KERNEL_DEVICE)[0], KERNEL_DEVICE, torch.float32)
    assert lr_scale > 0 and tau_offset is True
    entry = V.check_op(op, KERNEL_DEVICE, timing=False)
    assert entry["passed"] and entry["error"] <= V.TOL[torch.float32], entry
    assert entry["sha256"] != V.check_op("ttt_linear_bidir", KERNEL_DEVICE, timing=False)["sha256"]
    _perturb(monkeypatch, op, backward=1.01)
    assert not V.check_op(op, KERNEL_DEVICE, timing=False)["passed"]


@triton_test
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_wrong_kernel_fails_falls_back_and_warns_one_line(monkeypatch, where):
    _perturb(monkeypatch, OP, **{where: 1.01})  # 1e-2 relative: above the float32 tolerance (2e-3), far above noise
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert V.verified(OP, KERNEL_DEVICE, torch.float32) is False
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    entry = V.cache_entry(OP, KERNEL_DEVICE, torch.float32)
    assert "\n" not in msg and OP in msg and entry["device"] in msg and "PyTorch runs instead" in msg, msg
    assert "ttt-zoo kernels --verify --json" in msg and "relative error" in msg, msg
    assert entry["case"].endswith(" output") == (where == "forward") and entry["case"] in msg, entry
    assert not entry["passed"] and 5e-3 < entry["error"] < 2e-2 and entry["choice"] == "torch", entry
    with warnings.catch_warnings(record=True) as again:  # decided: no second check, no second warning
        warnings.simplefilter("always")
        assert V.verified(OP, KERNEL_DEVICE, torch.float32) is False
    assert again == []


@triton_test
def test_the_faster_correct_path_is_chosen(monkeypatch):
    for faster, ms in (("triton", {"triton": 1.0, "torch": 2.0}), ("torch", {"triton": 3.0, "torch": 2.0})):
        monkeypatch.setattr(V, "_time_ms", lambda op, backend, inputs, dtype: ms[backend])
        entry = V.check_op(OP, KERNEL_DEVICE, timing=True)
        assert entry["passed"] and entry["ms"] == ms and entry["choice"] == faster, entry


def _fake_gpu(monkeypatch, name="Fake GPU 80GB"):
    """A CUDA device whose checks stand in for the kernels: every case passes at no cost; returns the list of
    checks run.  Nothing touches CUDA."""
    monkeypatch.setattr(B, "HAS_TRITON", True)
    monkeypatch.setattr(V, "device_name", lambda device: name if device.type == "cuda" else "cpu")
    monkeypatch.setattr(V, "case_inputs", lambda op, shape, device, dtype, seed=0: [torch.zeros(2)])
    monkeypatch.setattr(V, "compare_paths", lambda op, new, ref, dtype: (1e-7, "output"))
    monkeypatch.setattr(V, "_time_ms", lambda op, backend, inputs, dtype: {"triton": 1.0, "torch": 2.0}[backend])
    runs = []
    real = V.check_op
    monkeypatch.setattr(V, "check_op", lambda *a, **k: runs.append(a[:3]) or real(*a, **k))
    return runs


def _new_process():
    V.clear_verification_cache()  # what a new process starts with: only the cache file on disk


def test_the_cache_is_keyed_by_device_versions_source_and_dtype(monkeypatch):
    runs = _fake_gpu(monkeypatch)
    assert B.resolve_backend("auto", CUDA, torch.float32, 16, OP) == "triton"  # checked, faster: the kernel
    assert len(runs) == 1
    for _ in range(2):  # the same key: the cache answers, in this process and the next
        assert B.resolve_backend("auto", CUDA, torch.float32, 16, OP) == "triton"
        _new_process()
    assert len(runs) == 1
    changes = [lambda: monkeypatch.setattr(V, "kernel_source_hash", lambda op, root=None: "0" * 64),
               lambda: monkeypatch.setattr(torch, "__version__", "9.9.9"),
               lambda: monkeypatch.setattr(V, "triton_version", lambda: "9.9.9"),
               lambda: monkeypatch.setattr(V, "device_name", lambda device: "Other GPU")]
    for i, change in enumerate(changes, start=2):
        change()
        _new_process()
        assert B.resolve_backend("auto", CUDA, torch.float32, 16, OP) == "triton"
        assert B.resolve_backend("auto", CUDA, torch.float32, 16, OP) == "triton"
        assert len(runs) == i, i  # one new check per change
    B.resolve_backend("auto", CUDA, torch.float16, 16, OP)
    assert len(runs) == len(changes) + 2 and runs[-1][2] == torch.float16  # another dtype: another check
    entries = json.loads(V.cache_path().read_text())
    assert len(entries) == len(runs) and {e["op"] for e in entries} == {OP}
    assert {"device", "torch", "triton", "sha256", "dtype", "passed", "error", "tol", "ms", "choice"} <= set(entries[0])
    assert not torch.cuda.is_initialized()


def test_a_repository_record_needs_no_check_and_forcing_runs_none(monkeypatch, tmp_path):
    runs = _fake_gpu(monkeypatch)
    records = tmp_path / "records.json"
    records.write_text(json.dumps([dict(op=OP, sha256=V.kernel_source_hash(OP))]))
    monkeypatch.setenv(V.RECORDS_ENV, str(records))
    _new_process()
    assert B.resolve_backend("auto", CUDA, torch.float32, 16, OP) == "triton"
    other = next(op for op in KERNEL_OPS if V.kernel_source_hash(op) != V.kernel_source_hash(OP))
    for forced in ("triton", "torch", "torch_naive"):
        assert B.resolve_backend(forced, CUDA, torch.float32, 16, other) == forced
        with B.use_backend(forced):
            assert B.resolve_backend(None, CUDA, torch.float32, 16, other) == forced
    monkeypatch.setenv(B.ENV_VAR, "torch")
    assert B.resolve_backend(None, CUDA, torch.float32, 16, other) == "torch"
    assert runs == []


def test_a_corrupt_cache_warns_once_and_is_checked_again(monkeypatch):
    runs = _fake_gpu(monkeypatch)
    V.cache_path().parent.mkdir(parents=True)
    V.cache_path().write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the kernel check cache") as caught:
        assert V.verified(OP, CUDA, torch.float32) and V.verified(OP, CUDA, torch.bfloat16)
    assert len([w for w in caught if "kernel check cache" in str(w.message)]) == 1 and len(runs) == 2
    assert len(json.loads(V.cache_path().read_text())) == 2  # rewritten whole


def test_no_check_under_torch_compile(monkeypatch):
    runs = _fake_gpu(monkeypatch)

    def pick(x):
        return x + (1.0 if B.resolve_backend("auto", CUDA, torch.float32, 16, OP) == "triton" else 2.0)

    torch._dynamo.reset()
    assert torch.compile(pick, backend="eager", fullgraph=True)(torch.zeros(2)).tolist() == [2.0, 2.0]
    assert runs == []  # not checked while tracing: PyTorch
    assert V.verified(OP, CUDA, torch.float32) and len(runs) == 1  # eager: checked now
    torch._dynamo.reset()
    assert torch.compile(pick, backend="eager", fullgraph=True)(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert len(runs) == 1  # tracing reads the cached check
    torch._dynamo.reset()


def test_no_check_under_export_tracing_or_exportable(monkeypatch):
    import timm.layers
    runs = _fake_gpu(monkeypatch)

    class Pick(torch.nn.Module):
        def forward(self, x):
            return x + (1.0 if V.verified(OP, CUDA, torch.float32) else 2.0)

    exported = torch.export.export(Pick(), (torch.zeros(2),))
    assert exported.module()(torch.zeros(2)).tolist() == [2.0, 2.0]
    traced = torch.jit.trace(Pick(), torch.zeros(2), check_trace=False)  # (its check reruns it eagerly)
    assert traced(torch.zeros(2)).tolist() == [2.0, 2.0]
    with timm.layers.set_layer_config(exportable=True):
        assert not V.verified(OP, CUDA, torch.float32)
    assert runs == []


def _cli(*args, env=None):
    env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ttt_zoo", "kernels", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=900)


def test_kernels_command_names_every_op():
    ops = available_ops()
    text = _cli()
    assert text.returncode == 0, text.stderr[-3000:]
    lines = text.stdout.splitlines()
    assert lines[0].startswith("device: ") and f"torch {torch.__version__}" in lines[0]
    for op, paths in ops.items():
        row = next(line for line in lines if line.split()[:1] == [op])
        assert ",".join(p for p, has in paths.items() if has) in row, row
    report = json.loads(_cli("--json").stdout)
    assert report["torch"] == str(torch.__version__) and report["triton"] == V.triton_version()
    assert [r["op"] for r in report["ops"]] == sorted(ops)
    assert all(r["pick"].split()[0] in ("torch", "triton") and r["why"] for r in report["ops"])
    bad = _cli("--device", "tpu")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --device tpu") \
        and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.mark.triton
def test_kernels_verify_checks_every_kernel_op_on_the_cpu(tmp_path):
    env = {V.CACHE_ENV: str(tmp_path / "cli_cache")}
    r = _cli("--verify", "--json", "--device", "cpu", env=dict(env, TRITON_INTERPRET="0"))  # reruns itself with 1
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["triton_interpret"] and [row["op"] for row in report["ops"]] == sorted(available_ops())
    checked = {row["op"]: row["check"] for row in report["ops"] if "check" in row}
    assert sorted(checked) == KERNEL_OPS
    assert all(c["passed"] and c["error"] <= c["tol"] for c in checked.values()), checked
    cached = json.loads((tmp_path / "cli_cache" / "kernel_checks.json").read_text())
    assert sorted(e["op"] for e in cached) == KERNEL_OPS
