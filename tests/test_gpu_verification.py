"""Verified-only kernel defaults (``kernels/verify.py``, decided in ``kernels/backend.py``) and the dry run of ``tools/gpu_check.py``.

On CUDA, ``auto`` picks an op's kernel only where a GPU verification record matches the op's current kernel
sources; forcing the kernel ignores the records; the CPU never reads them.  Checked without a GPU: the decision
reads only the device type (``torch.cuda`` is never initialised).
"""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ttt_zoo.kernels import available_ops
from ttt_zoo.kernels import backend as B
from ttt_zoo.kernels import verify as V

KERNEL = B.TRITON_BACKEND
KERNEL_OPS = sorted(op for op, impls in available_ops().items() if impls[KERNEL])
CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """Fresh caches (as in a new process), the kernels 'installed', no forced backend; the records alone decide
    (no local check, as off a GPU: tests/test_kernel_verify.py tests those)."""
    monkeypatch.setattr(B, "HAS_TRITON", True)
    monkeypatch.setattr(V, "device_name", lambda device: None)
    monkeypatch.delenv(B.ENV_VAR, raising=False)
    monkeypatch.delenv(B.RECORDS_ENV, raising=False)
    B.clear_verification_cache()
    yield
    B.clear_verification_cache()


def _records(monkeypatch, tmp_path, records):
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    monkeypatch.setenv(B.RECORDS_ENV, str(path))
    B.clear_verification_cache()


def _record(op, root=None):
    return dict(op=op, sha256=B.kernel_source_hash(op, root), gpu="test", torch="x", cuda="x", date="2000-01-01",
                command="pytest", **{KERNEL: "x"})


def test_every_kernel_op_has_sources():
    assert KERNEL_OPS and "last_layer_ttt" not in KERNEL_OPS
    for op in KERNEL_OPS:
        names = [f.relative_to(B.KERNELS_DIR).as_posix() for f in B.kernel_sources(op)]
        assert f"{B.kernel_folder(op)}/{KERNEL}.py" in names, op
        assert len(B.kernel_source_hash(op)) == 64


def test_repository_records_file_is_valid_and_decides():
    records = json.loads((B.KERNELS_DIR / "gpu_verified.json").read_text())
    assert isinstance(records, list)
    keys = {"op", "sha256", "files", "gpu", "torch", KERNEL, "cuda", "date", "command"}
    assert all(keys <= set(r) for r in records)
    for op in KERNEL_OPS:  # auto takes the kernel on CUDA exactly where a record matches (today: none)
        expected = KERNEL if B.gpu_verified(op) else "torch"
        assert B.resolve_backend("auto", CUDA, torch.float32, 32, op) == expected, op


@pytest.mark.parametrize("records", [[], [dict(op="x", sha256="0")]], ids=["empty", "other"])
def test_no_matching_record_means_pytorch_on_cuda(records, monkeypatch, tmp_path):
    _records(monkeypatch, tmp_path, records + [dict(_record(op), sha256="0" * 64) for op in KERNEL_OPS])
    for op in KERNEL_OPS:
        assert B.resolve_backend("auto", CUDA, torch.float16, 32, op) == "torch", op
        assert B.resolve_backend(None, CUDA, torch.float32, 32, op) == "torch", op
    assert not torch.cuda.is_initialized()


def test_matching_record_selects_the_kernel(monkeypatch, tmp_path):
    for op in KERNEL_OPS:
        _records(monkeypatch, tmp_path, [_record(op)])
        assert B.resolve_backend("auto", CUDA, torch.float16, 32, op) == KERNEL, op
        assert B.resolve_backend("auto", CUDA, torch.float64, 32, op) == "torch", op  # no fp64 kernels
        assert B.resolve_backend("auto", torch.device("cpu"), torch.float32, 32, op) == "torch", op
        others = [o for o in KERNEL_OPS if o != op]  # a record counts for its op alone, not its folder's others
        assert all(B.resolve_backend("auto", CUDA, torch.float32, 32, o) == "torch" for o in others), op
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("verified", [False, True], ids=["no_record", "record"])
def test_decision_traces_under_torch_compile(verified, monkeypatch, tmp_path):
    # auto on CUDA reads the records (files) while deciding: torch.compile(fullgraph=True) of a model on a GPU
    # failed on it (the lease of 2026-11-26); the decision must trace as a constant, same answer as eager
    for op in KERNEL_OPS:
        _records(monkeypatch, tmp_path, [_record(op)] if verified else [])
        torch._dynamo.reset()
        expected = KERNEL if verified else "torch"

        @torch.compile(backend="eager", fullgraph=True)
        def decide(x):
            return x + (1 if B.resolve_backend("auto", CUDA, x.dtype, 32, op) == KERNEL else 2)

        assert decide(torch.zeros(2)).tolist() == [1.0 if verified else 2.0] * 2, op
        assert B.resolve_backend("auto", CUDA, torch.float32, 32, op) == expected, op
    assert not torch.cuda.is_initialized()


def test_editing_a_kernel_invalidates_its_record(monkeypatch, tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(B.KERNELS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(V, "KERNELS_DIR", copy)  # where the hashes are made
    _records(monkeypatch, tmp_path, [_record(op) for op in KERNEL_OPS])
    assert all(B.gpu_verified(op) for op in KERNEL_OPS)
    (copy / "README.md").write_text("edited\n")  # not a kernel source
    (copy / "key_norm" / f"{KERNEL}.py").write_text((copy / "key_norm" / f"{KERNEL}.py").read_text() + "# edit\n")
    B.clear_verification_cache()  # the hashes are computed once per process: a new process
    for op in KERNEL_OPS:
        edited = any(f.name == f"{KERNEL}.py" and f.parent.name == "key_norm" for f in B.kernel_sources(op))
        assert B.gpu_verified(op) is not edited, op
        assert B.resolve_backend("auto", CUDA, torch.float32, 32, op) == ("torch" if edited else KERNEL), op
    assert not B.gpu_verified("key_instance_norm")
    shared = copy / f"{KERNEL}_utils.py"  # a module every other kernel imports
    shared.write_text(shared.read_text() + "# edit\n")
    B.clear_verification_cache()
    assert [op for op in KERNEL_OPS if B.gpu_verified(op)] == []


def test_dot_loss_runs_on_triton_only_where_its_own_op_is_verified(monkeypatch, tmp_path):
    """On ``auto`` a CUDA device with a record for ``ttt_linear_bidir`` alone runs the MSE loss on the kernels and
    the dot loss (the linear-attention forms) on PyTorch; a record for ``linear_attention_bidir`` the reverse."""
    from types import SimpleNamespace
    from ttt_zoo.layers import create_mixer
    mixers = {loss: create_mixer("ttt_linear", 32, head_dim=16, inner_loss=loss) for loss in ("mse", "dot")}
    q = SimpleNamespace(device=CUDA, dtype=torch.float16)  # what the choice reads of q: no CUDA needed
    for record, on_triton in (("ttt_linear_bidir", "mse"), ("linear_attention_bidir", "dot")):
        _records(monkeypatch, tmp_path, [_record(record)])
        assert {loss: m._rate_in_kernels(q) for loss, m in mixers.items()} == \
            {loss: loss == on_triton for loss in mixers}, record
    assert not torch.cuda.is_initialized()


def test_dot_loss_scan_record_covers_the_ttt_linear_kernels(monkeypatch, tmp_path):
    """``linear_attention_bidir`` runs ``ttt_linear/``'s kernels: editing them invalidates its record (and not
    ``linear_attention``'s, whose forward kernel is its own)."""
    copy = tmp_path / "kernels"
    shutil.copytree(B.KERNELS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(V, "KERNELS_DIR", copy)
    ops = ("linear_attention_bidir", "ttt_linear_bidir", "linear_attention")
    _records(monkeypatch, tmp_path, [_record(op) for op in ops])
    assert all(B.gpu_verified(op) for op in ops)
    names = [f.relative_to(copy).as_posix() for f in B.kernel_sources("linear_attention_bidir")]
    assert {"ttt_linear/triton.py", "ttt_linear/ops.py", "linear_attention/bidir.py"} <= set(names), names
    kernel = copy / "ttt_linear" / f"{KERNEL}.py"
    kernel.write_text(kernel.read_text() + "# edit\n")
    B.clear_verification_cache()
    assert [B.gpu_verified(op) for op in ops] == [False, False, True]


def test_forced_kernel_ignores_records(monkeypatch, tmp_path):
    _records(monkeypatch, tmp_path, [])
    for op in KERNEL_OPS:
        assert B.resolve_backend(KERNEL, CUDA, torch.float32, 32, op) == KERNEL, op
        assert B.resolve_backend(None, CUDA, torch.float32, 32, op) == "torch", op  # the choice ends with its call
    B.clear_verification_cache()
    monkeypatch.setenv(B.ENV_VAR, KERNEL)
    for op in KERNEL_OPS:
        assert B.resolve_backend(None, CUDA, torch.float32, 32, op) == KERNEL, op
    assert not torch.cuda.is_initialized()


def test_cpu_ignores_records(monkeypatch, tmp_path):
    _records(monkeypatch, tmp_path, [_record(op) for op in KERNEL_OPS])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for op in KERNEL_OPS:
        assert B.resolve_backend("auto", torch.device("cpu"), torch.float32, 16, op) == "torch"
        assert B.resolve_backend(KERNEL, torch.device("cpu"), torch.float32, 16, op) == KERNEL


def test_unreadable_records_warn_and_mean_pytorch(monkeypatch, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    monkeypatch.setenv(B.RECORDS_ENV, str(path))
    with pytest.warns(UserWarning, match="ignoring the GPU verification records"):
        assert B.resolve_backend("auto", CUDA, torch.float32, 32, KERNEL_OPS[0]) == "torch"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # timm registers its models by module
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_rejects_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "gpu_check", raising=False)
    gc = _gpu_check()
    for argv, msg in ((["--dry-run", "--only-ops", "nope"], "no kernel op nope"),
                      (["--dry-run", "--records", str(B.KERNELS_DIR / "gpu_verified.json")], "never writes")):
        with pytest.raises(SystemExit):
            gc.main(argv + ["--output", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert "error:" in err[-1] and msg in err[-1], err


def test_gpu_check_dry_run(tmp_path):
    repo_records = (B.KERNELS_DIR / "gpu_verified.json").read_bytes()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--output", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    for step in ("tests", "bench", "profile", "records"):
        assert f"| {step} |" in summary, summary
    assert (out / "tests" / "test_kernels_cuda.xml").is_file() and (out / "bench" / "bench.md").is_file()
    assert (out / "profile" / "profile.md").is_file()
    records = json.loads((out / "gpu_verified.json").read_text())
    assert [r["op"] for r in records] == ["key_instance_norm"]
    assert records[0]["sha256"] == B.kernel_source_hash("key_instance_norm") and "pytest" in records[0]["command"]
    assert (B.KERNELS_DIR / "gpu_verified.json").read_bytes() == repo_records  # the repository's file untouched


def test_a_record_needs_every_collected_cuda_case_run_and_passed(monkeypatch):
    """``passed_ops`` against the ids a file collected (``tools/pytest_collected.py``): a ``cuda`` file cut off by
    its time limit (a case collected, never reached) or with a failed or skipped case gives no record."""
    monkeypatch.delitem(sys.modules, "gpu_check", raising=False)
    gc = _gpu_check()
    op = "key_instance_norm"
    ids = [f"test_kernel_matches_pytorch[{op}-3x77x16-fp32]",
           f"test_kernel_on_non_contiguous_inputs[{op}-3x77x16-bf16]"]
    other = "test_kernel_matches_pytorch[linear_attention-1x2x999x16x16-fp32]"  # another op's case: not counted

    def results(cases, rc=0, collected=ids + [other], folder_rc=0):
        return {"test_op_key_norm.py": (folder_rc, {"test_key_norm_kernels[fp32-B3N20C16]": "passed"}, "op", ["x"]),
                gc.CUDA_TESTS.name: (rc, cases, "cuda", collected)}

    every = {i: "passed" for i in ids}
    assert gc.passed_ops(results(every), dry_run=False) == {op: "op; cuda"}
    assert gc.passed_ops(results({**every, other: "failed"}, rc=1), dry_run=False) == {op: "op; cuda"}
    assert gc.passed_ops(results({ids[0]: "passed"}, rc=124), dry_run=False) == {}  # cut off before the second
    assert gc.passed_ops(results({ids[0]: "passed", ids[1]: "failed"}, rc=1), dry_run=False) == {}
    assert gc.passed_ops(results({ids[0]: "passed", ids[1]: "skipped"}), dry_run=False) == {}
    assert gc.passed_ops(results({ids[0]: "passed", ids[1]: "skipped"}), dry_run=True) == {op: "op; cuda"}
    assert gc.passed_ops(results(every, collected=[]), dry_run=False) == {}  # nothing known to have been collected
    assert gc.passed_ops(results(every, folder_rc=124), dry_run=False) == {}  # the op's own file cut off


def test_gpu_check_sizes_pick_the_benchmark_sizes_and_their_latents(monkeypatch, tmp_path):
    """``--sizes 224`` (the lease's family benchmark): the classifiers at 224 only, the DiTs at its latent 28 only."""
    monkeypatch.delitem(sys.modules, "gpu_check", raising=False)
    gc = _gpu_check()
    cmds = {name: cmd for name, cmd, _ in gc._bench_cmds(gc.build_parser().parse_args(["--sizes", "224"]), tmp_path)}
    assert sorted(cmds) == ["bench_classification", "bench_diffusion_28", "profile"], sorted(cmds)
    sizes = cmds["bench_classification"][cmds["bench_classification"].index("--img-size") + 1:]
    assert sizes[:2] == ["224", "--batch-tokens"]
    assert set(gc.CLASSIFIERS) <= set(cmds["bench_classification"])
    every = {name for name, _, _ in gc._bench_cmds(gc.build_parser().parse_args([]), tmp_path)}
    assert every == {"bench_classification", "profile"} | {f"bench_diffusion_{n}" for n in (28, 64, 128, 256)}
