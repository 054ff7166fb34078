"""``ttt-zoo bench``: a tiny end-to-end run on the CPU, the op dry run, the report code and argument errors.

Timings here are not benchmarks (1 warm-up + 1 step on a shared machine); the tests check the plumbing: that every
key timm's benchmark.py writes is there with sane values, that the parameter count is the model's, that the
outputs are written, and that bad arguments are refused with a message saying what to do.
"""
import csv
import json
import math
import os

import pytest
import timm
import torch

import ttt_zoo  # noqa: F401
from ttt_zoo.bench import format_table, measure_steps, scaling_exponents, write_results
from ttt_zoo.cli import main

from test_registry_contract import small_kwargs

TIMM_KEYS = ("samples_per_sec", "step_time", "batch_size", "img_size", "gmacs")


def test_bench_end_to_end_cpu(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--model", "vit3_tiny", "--peers", "test_vit", "--img-size", "48x32", "--bench", "both",
               "-b", "2", "--num-warm-iter", "1", "--num-bench-iter", "1", "--device", "cpu", "--threads", "1",
               "--output", str(out), "--results-file", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr()
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["threads"] == "1"
    rows = {r["model"]: r for r in data["results"]}
    assert set(rows) == {"vit3_tiny", "test_vit"}
    for name, r in rows.items():
        n_params = sum(p.numel() for p in timm.create_model(name, img_size=(48, 32)).parameters())
        assert r["param_count"] * 1e6 == pytest.approx(n_params, abs=0.5)
        for p in ("infer", "train"):
            for k in TIMM_KEYS:
                assert f"{p}_{k}" in r, (name, p, k)
            assert r[f"{p}_img_size"] == "48x32" and r[f"{p}_batch_size"] == 2
            assert r[f"{p}_step_time"] > 0 and r[f"{p}_gmacs"] > 0 and r[f"{p}_peak_mem_mb"] >= 0
            assert r[f"{p}_samples_per_sec"] == pytest.approx(2e3 / r[f"{p}_step_time"], rel=1e-3)
            assert r[f"{p}_threads"] == 1
        # training keeps activations and gradients: more memory than inference
        assert r["train_peak_mem_mb"] > r["infer_peak_mem_mb"]
    assert rows["vit3_tiny"]["infer_gmacs"] > rows["test_vit"]["infer_gmacs"]
    md = (out / "bench.md").read_text()
    assert "time / test_vit" in md and "| 48x32 | vit3_tiny |" in md and "torch " + torch.__version__ in md
    assert not (out / "results.csv").exists()  # --results-file given: no second results file in --output
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_onnxruntime_beside_torch(tmp_path, capsys):
    # the exported graph in onnxruntime, side by side with eager torch; training rows are not made for it
    rc = main(["bench", "--model", "vit3_tiny", "--model-kwargs", "depth=1", "--img-size", "64",
               "--runtime", "torch", "onnxruntime", "--bench", "both", "--num-warm-iter", "1",
               "--num-bench-iter", "1", "--device", "cpu", "--threads", "1", "--results-file", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr()
    rows = {r["label"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert set(rows) == {"vit3_tiny", "vit3_tiny (onnxruntime)"}
    ort_row, torch_row = rows["vit3_tiny (onnxruntime)"], rows["vit3_tiny"]
    assert ort_row["runtime"] == "onnxruntime" and ort_row["infer_step_time"] > 0
    assert "train_step_time" not in ort_row and torch_row["train_step_time"] > 0
    assert ort_row["param_count"] == torch_row["param_count"]


def test_bench_grad_checkpointing_keeps_less_for_the_backward(tmp_path, capsys):
    # timm's --grad-checkpointing: the blocks' activations are recomputed, so autograd keeps less
    saved = {}
    for flag in ([], ["--grad-checkpointing"]):
        rc = main(["bench", "--model", "vit3_tiny", "--model-kwargs", "depth=2", "--img-size", "64", "--bench",
                   "train", "--saved-mem", "--num-warm-iter", "0", "--num-bench-iter", "1", "--device", "cpu",
                   "--threads", "1", "--results-file", str(tmp_path / f"r{len(flag)}.json")] + flag)
        assert rc == 0, capsys.readouterr()
        saved[bool(flag)] = json.loads((tmp_path / f"r{len(flag)}.json").read_text())["results"][0]["train_saved_mb"]
    assert 0 < saved[True] < 0.5 * saved[False], saved


def test_bench_compile_beside_eager(tmp_path, capsys):
    # --runtime torch compile: an eager row and a torch.compile row (--torchcompile's backend) side by side
    rc = main(["bench", "--model", "vit3_tiny", "--model-kwargs", "depth=1", "--img-size", "64",
               "--runtime", "torch", "compile", "--torchcompile", "eager", "--torchcompile-mode", "default", "--bench", "both",
               "--num-warm-iter", "1",
               "--num-bench-iter", "1", "--device", "cpu", "--threads", "1", "--results-file", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr()
    rows = {r["label"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert set(rows) == {"vit3_tiny", "vit3_tiny (compile)"}
    assert rows["vit3_tiny"]["torchcompile"] == "" and rows["vit3_tiny (compile)"]["torchcompile"] == "eager"
    assert rows["vit3_tiny"]["torchcompile_mode"] == "" and rows["vit3_tiny (compile)"]["torchcompile_mode"] == "default"
    for r in rows.values():
        assert r["infer_step_time"] > 0 and r["train_step_time"] > 0


def test_bench_before_measures_the_older_revision(tmp_path, capsys):
    # --before REV: the model measured with the ttt_zoo of that git revision too (run from the checkout's root,
    # where `python -m` would otherwise import this checkout's ttt_zoo)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, ".git")):
        pytest.skip("not a git checkout")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        rc = main(["bench", "--model", "vit3_tiny", "--model-kwargs", "depth=1", "--img-size", "64", "--before", "HEAD",
                   "--bench", "inference", "--num-warm-iter", "1", "--num-bench-iter", "1", "--device", "cpu",
                   "--threads", "1", "--results-file", str(tmp_path / "r.json")])
    finally:
        os.chdir(cwd)
    assert rc == 0, capsys.readouterr()
    rows = {r["label"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    assert set(rows) == {"vit3_tiny", "vit3_tiny (HEAD)"}
    assert all("infer_error" not in r and r["infer_step_time"] > 0 for r in rows.values()), rows


def test_ops_dry_run(tmp_path):
    rc = main(["bench", "--ops", "key_instance_norm", "--dry-run", "--results-file", str(tmp_path / "ops.csv"),
               "--output", str(tmp_path)])
    assert rc == 0
    with open(tmp_path / "ops.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["backend"] for r in rows] == ["triton", "torch", "torch_naive"]
    for r in rows:
        assert float(r["fwd_ms"]) > 0 and float(r["fwd_bwd_ms"]) > 0
        assert float(r["out_diff"]) < 1e-5 and float(r["grad_rel_diff"]) < 1e-5  # fp32 vs the fp32 reference
    assert "DRY RUN" in (tmp_path / "ops.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--model", "no_such_model"], "--model 'no_such_model' is not a registered model"),
    (["--peers", "no_such_peer"], "--peers 'no_such_peer' is not a registered model"),
    (["--img-size", "abc"], "bad image size 'abc'"),
    (["--img-size", "0"], "bad image size '0'"),
    (["--img-size", "224x"], "bad image size '224x'"),
    (["-b", "0"], "argument -b/--batch-size: 0 is out of range"),
    (["--results-file", "r.txt"], "must end in .csv or .json"),
    (["--ops", "no_such_op", "--dry-run"], "unknown op(s) ['no_such_op']"),
    (["--dry-run"], "--dry-run applies to --ops"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--device", "cpu", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_import_registers_a_local_peer(tmp_path, monkeypatch, capsys):
    # --import: a module on PYTHONPATH that registers a model with timm is a peer, here and in every child; the
    # module makes the GMACs count on the meta device fail (it calls .item() while building), so the count falls
    # back to the built model
    (tmp_path / "local_peer_mod.py").write_text(
        "import torch, timm\n"
        "from timm.models import register_model\n"
        "class Local(torch.nn.Module):\n"
        "    def __init__(self, num_classes=10, **kw):\n"
        "        super().__init__()\n"
        "        self.num_classes = num_classes\n"
        "        self.conv = torch.nn.Conv2d(3, 64, 3, padding=1)\n"
        "        self.fc = torch.nn.Linear(64, num_classes)\n"
        "        self.k = float(torch.ones(1).sum().item())\n"
        "    def forward(self, x):\n"
        "        return self.fc(self.conv(x).mean((2, 3))) * self.k\n"
        "@register_model\n"
        "def local_peer_tiny(pretrained=False, **kw):\n"
        "    kw.pop('img_size', None)\n"
        "    return Local(**{k: v for k, v in kw.items() if k == 'num_classes'})\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["bench", "--import", "local_peer_mod", "--model", "vit3_tiny", "--model-kwargs", "depth=1",
               "--peers", "local_peer_tiny", "--img-size", "32", "--bench", "inference", "--num-warm-iter", "0",
               "--num-bench-iter", "1", "--device", "cpu", "--threads", "1", "--results-file",
               str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr()
    rows = {r["label"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]}
    peer = rows["local_peer_tiny"]
    assert peer["role"] == "peer" and peer["infer_step_time"] > 0
    assert peer["infer_gmacs"] == pytest.approx((32 * 32 * 64 * 27 + 640) / 1e9, abs=1e-4)  # the conv + the fc
    with pytest.raises(SystemExit):  # a module that cannot be imported: a usage error naming the flag
        main(["bench", "--import", "no_such_module_xyz", "--device", "cpu"])
    assert "--import no_such_module_xyz" in capsys.readouterr().err


def _row(label, role, h, infer_ms, mem):
    return dict(model=label, label=label, role=role, img_size=h, img_h=h, img_w=h, param_count=1.0,
                infer_step_time=infer_ms, infer_samples_per_sec=1e3 / infer_ms, infer_batch_size=1,
                infer_peak_mem_mb=mem, infer_gmacs=0.5)


def test_report_ratios_exponents_and_files(tmp_path):
    # "a" scales linearly in pixels, the peer "b" as pixels^1.5; a is 2x slower than b at 64, 2x faster at 256
    rows = [_row("a", "model", 64, 20.0, 10.0), _row("b", "peer", 64, 10.0, 20.0),
            _row("a", "model", 256, 320.0, 40.0), _row("b", "peer", 256, 640.0, 80.0)]
    exps = scaling_exponents(rows)
    assert exps[("a", "infer")] == pytest.approx(1.0) and exps[("b", "infer")] == pytest.approx(1.5)
    table = format_table(rows)
    assert "| 64 | a | 1 | 1.00 | 0.500 | 20.0 | 50.0 | 10.0 | 50.0 | 2.00x | 0.50x |" in table
    assert "| 256 | a |" in table and "| 0.50x | 0.50x |" in table
    # a second peer: ratios to every peer, side by side
    two = format_table(rows + [_row("c", "peer", 64, 40.0, 5.0)])
    assert "time / b | memory / b | time / c | memory / c |" in two
    assert "| 64 | a | 1 | 1.00 | 0.500 | 20.0 | 50.0 | 10.0 | 50.0 | 2.00x | 0.50x | 0.50x | 2.00x |" in two
    write_results(str(tmp_path / "r.csv"), rows)
    with open(tmp_path / "r.csv") as f:
        back = list(csv.DictReader(f))
    assert [float(r["infer_step_time"]) for r in back] == [20.0, 10.0, 320.0, 640.0]
    write_results(str(tmp_path / "r.json"), rows, dict(cpu="x"))
    assert json.loads((tmp_path / "r.json").read_text())["results"] == rows
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]  # atomic writes leave no temp files
    with pytest.raises(ValueError, match="csv or .json"):
        write_results(str(tmp_path / "r.txt"), rows)


def test_measure_steps_sees_peak_memory_and_time():
    n = 16 * 2 ** 20  # 64 MiB of fp32, allocated and touched inside the step, freed after it
    res = measure_steps(lambda: torch.ones(n).sum(), "cpu", 1, 2)
    assert res["step_time"] > 0 and len(res["step_times"]) == 2
    assert 56 < res["peak_mem_mb"] < 200
    assert math.isfinite(res["cpu_time"])


def test_bench_malloc_trim_reaches_the_children_and_lowers_the_cpu_peak(tmp_path, capsys):
    # --malloc-trim: every child runs with glibc returning freed memory, so the peak RSS follows the live tensors;
    # the same training step then shows a lower (or equal) peak than with glibc's retained heap
    peaks = {}
    for flag in ([], ["--malloc-trim"]):
        rc = main(["bench", "--model", "t5_tiny", "--model-kwargs", "depth=4", "--img-size", "256", "--bench",
                   "train", "--num-warm-iter", "1", "--num-bench-iter", "2", "--device", "cpu", "--threads", "1",
                   "--results-file", str(tmp_path / f"r{len(flag)}.json")] + flag)
        assert rc == 0, capsys.readouterr()
        row = json.loads((tmp_path / f"r{len(flag)}.json").read_text())["results"][0]
        assert row["train_malloc_trim"] is bool(flag)
        peaks[bool(flag)] = row["train_peak_mem_mb"]
    assert 0 < peaks[True] < peaks[False], peaks


def test_compile_parity_rule_lets_float64_arbitrate():
    """``parity_ok``: compiled passes when it equals eager fp32, or, where the two fp32 runs part (a ReLU kink),
    eager fp64; it fails when it is off from both."""
    from ttt_zoo.bench.compile import parity_ok
    close = dict(fwd=4e-7, grad=2e-6, fwd_f64=4e-7, grad_f64=2e-6)
    assert parity_ok(close)
    assert parity_ok(dict(close, grad=8.2e-4))  # eager fp32 flipped a ReLU gradient; compiled matches fp64
    assert not parity_ok(dict(close, grad=8.2e-4, grad_f64=7e-4))
    assert not parity_ok(dict(close, fwd=3e-4, fwd_f64=3e-4))


def test_child_error_names_the_signal_that_killed_a_child():
    """A child killed by a signal leaves some library's log line last on stderr (the profiler's 'ERROR: ...
    gpuGetDeviceCount failed' here): the report names the signal instead of passing that line off as the cause."""
    import signal
    import subprocess
    import sys
    from ttt_zoo.bench.measure import child_error
    code = ("import os, signal, sys; print('ERROR: DeviceProperties.cpp:56] gpuGetDeviceCount failed', "
            "file=sys.stderr); sys.stderr.flush(); os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL
    msg = child_error(out.returncode, out.stderr)
    assert msg.startswith("child killed by SIGKILL") and "out of memory" in msg and "gpuGetDeviceCount" in msg, msg
    out = subprocess.run([sys.executable, "-c", "raise ValueError('img_size 100 is not a multiple of 16')"],
                         capture_output=True, text=True)
    assert child_error(out.returncode, out.stderr) == "ValueError: img_size 100 is not a multiple of 16"
    assert child_error(3, "") == "child exited with status 3 and printed nothing on stderr"


def test_bench_profile_averages_steps_profiled_one_at_a_time(tmp_path, capsys):
    """--profile: every step is profiled on its own (bounded memory) and the totals are averaged per step, so the
    calls per step do not depend on how many steps were profiled.  With every operator listed, the unrounded shares
    in profile.json add up to 100 %, and profile.md shows them rounded to 0.1 %."""
    tables = {}
    for iters in ("1", "3"):
        out = tmp_path / iters
        rc = main(["bench", "--profile", "--model", "vit3_tiny", "--model-kwargs", "depth=2", "--img-size", "64",
                   "-b", "2", "--bench", "train", "--num-warm-iter", "1", "--num-bench-iter", iters,
                   "--profile-top", "100000", "--threads", "1", "--output", str(out)])
        assert rc == 0, capsys.readouterr()
        rows = [line.split("|")[1:-1] for line in (out / "profile.md").read_text().splitlines()
                if line.startswith("| `")]
        (prof,) = json.loads((out / "profile.json").read_text())["results"]
        assert prof["num_ops"] == len(prof["ops"]) == len(rows)  # every operator is listed
        # the rounded table shows exactly the unrounded results (the rounding itself is not checked by a sum)
        assert [(r[0].strip(" `"), r[2].strip()) for r in rows] == [(o["op"], f"{o['share']:.1f}%") for o in prof["ops"]]
        tables[iters] = prof
    one, three = ({o["op"]: o for o in t["ops"]} for t in (tables["1"], tables["3"]))
    assert "aten::addmm" in one and "aten::mm" in one, sorted(one)
    assert {k: v["calls"] for k, v in one.items()} == {k: v["calls"] for k, v in three.items()}
    for t in tables.values():
        assert abs(sum(o["share"] for o in t["ops"]) - 100) < 1e-9
        assert abs(sum(o["ms"] for o in t["ops"]) - t["total_ms"]) <= 1e-9 * t["total_ms"]


def _gmacs_models():
    from ttt_zoo.registry import list_zoo_families
    return sorted(set(list_zoo_families().values()) | {"visionttt_tiny_la"})  # + the linear-attention op


@pytest.mark.parametrize("name", _gmacs_models())
def test_bench_gmacs_count_the_inner_step(name):
    """The GMACs column on the meta device, where the ``ttt_zoo::`` custom ops run only their fakes (backend
    triton), counts the inner step through the ops' FLOP formulas: it equals FlopCounterMode over the torch path
    (plain aten ops on the CPU) within 1 %.  Without the formulas it was 4-8 % short here.  The torch path's forward
    runs with gradients on, as in training, so that TTT-Linear runs the scan the kernels run (its no-grad forward
    is a chunked form with other MACs)."""
    from torch.utils import flop_counter
    from torch.utils.flop_counter import FlopCounterMode
    from ttt_zoo.bench.models import count_gmacs, create
    from ttt_zoo.kernels import use_backend
    size, kwargs = (96, 96), small_kwargs(name)  # one block per stage, small widths
    with use_backend("triton"):
        meta = count_gmacs(name, size, kwargs)
    model = create(name, size, kwargs).eval()
    # torch's FlopCounterMode has no formula for the CPU's fused attention op (a masked SDPA, T5+ / DiT5's
    # neighbourhood attention on small maps, counted 0): give it the one it has for the same op elsewhere
    def cpu_sdpa_flops(q, k, v, *args, out_shape=None, **kwargs):  # shapes (FlopCounterMode's shape_wrapper)
        return flop_counter.sdpa_flop_count(q, k, v)

    cpu_sdpa = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa_flops}
    with use_backend("torch"), FlopCounterMode(display=False, custom_mapping=cpu_sdpa) as counter:
        model(torch.randn(1, 3, *size))
    reference = counter.get_total_flops() / 2 / 1e9
    assert meta == pytest.approx(reference, rel=0.01), (meta, reference)


class _Evt:
    """The attributes torch's FunctionEventAvg rows have that the profile sums read."""

    def __init__(self, key, device_type, self_device_us=0.0, self_cpu_us=0.0, count=1, is_legacy=False,
                 is_user_annotation=False):
        self.key, self.device_type, self.count = key, device_type, count
        self.self_device_time_total, self.self_cpu_time_total = self_device_us, self_cpu_us
        self.is_legacy, self.is_user_annotation = is_legacy, is_user_annotation


def _fake_step():
    """One CUDA step as kineto reports it: the launch rows hold their kernels' time again, as does a
    record_function annotation on the device; one fp32 GEMM, one bf16 GEMM, a Triton kernel, a copy, a fill."""
    from torch.autograd import DeviceType
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    return [_Evt("aten::mm", cpu, 0.0, 30.0, count=2), _Evt("cudaLaunchKernel", cpu, 100.0 + 50.0 + 20.0, 12.0, 3),
            _Evt("cudaMemcpyAsync", cpu, 8.0, 5.0), _Evt("cudaMemsetAsync", cpu, 2.0, 3.0),
            _Evt("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32", gpu, 100.0),
            _Evt("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", gpu, 50.0),
            _Evt("_swiglu_fwd_kernel", gpu, 20.0),
            _Evt("Memcpy HtoD (Pageable -> Device)", gpu, 8.0), _Evt("Memset (Device)", gpu, 2.0),
            _Evt("## forward ##", gpu, 180.0, is_user_annotation=True)]


def test_profile_sums_each_kernel_once():
    """The device time of a step is the device rows' sum (180 us here), not every row's (540 us: each kernel again
    in its launch row, and the annotation spanning them); the step summary splits it into kernels and copies and
    the kernel time by element type (from the kernel names)."""
    from ttt_zoo.bench.profiling import device_time_us, kernel_is_fp32, step_summary
    rows = _fake_step()
    assert sum(r.self_device_time_total for r in rows) == 540.0  # the old sum: three times the truth here
    assert device_time_us(rows) == 180.0
    s = step_summary(rows, wall_us=360.0)
    assert s["device_ms"] == pytest.approx(0.18) and s["busy_pct"] == pytest.approx(50.0)
    assert (s["kernels"], s["copies"]) == (3, 2) and s["copy_ms"] == pytest.approx(0.01)
    assert s["fp32_share"] == pytest.approx(100 * 100 / 170) and s["half_share"] == pytest.approx(100 * 50 / 170)
    assert s["unknown_dtype_share"] == pytest.approx(100 * 20 / 170)
    two = step_summary(rows + rows, wall_us=720.0, steps=2)  # per step over two profiled steps
    assert two["device_ms"] == pytest.approx(0.18) and two["kernels"] == 3 and two["busy_pct"] == pytest.approx(50.0)
    for name, want in [("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", True),
                       ("void at::native::unrolled_elementwise_kernel<c10::BFloat16, float>", False),
                       ("ampere_sgemm_128x64_nn", True), ("ampere_fp16_s16816gemm_fp16_128x128", False),
                       ("_vit3_bwd_dq_kernel", None)]:
        assert kernel_is_fp32(name) is want, name


def test_profile_cpu_sum_matches_torchs_table():
    """On a real (CPU) profile of one ViT3 block, the CPU sum equals the "Self CPU time total" torch's own table
    prints (to its printed precision), and no row counts as device time."""
    import re
    from torch.profiler import ProfilerActivity, profile
    from ttt_zoo.bench.profiling import cpu_time_us, device_time_us
    model = timm.create_model("vit3_tiny", depth=1, img_size=64).train()
    x = torch.randn(1, 3, 64, 64)
    model(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    rows = prof.key_averages()
    m = re.search(r"Self CPU time total: ([\d.]+)(us|ms|s)\b", rows.table())
    printed = float(m.group(1)) * {"us": 1.0, "ms": 1e3, "s": 1e6}[m.group(2)]
    assert cpu_time_us(rows) == pytest.approx(printed, abs=0.5e-3 * {"us": 1.0, "ms": 1e3, "s": 1e6}[m.group(2)])
    assert device_time_us(rows) == 0


_HANG_PEER = """
import time
import timm
from timm.models import register_model

@register_model
def hang_peer_tiny(pretrained=False, **kw):
    open(__import__("os").environ["HANG_MARK"], "w").close()
    time.sleep(600)  # the second configuration never finishes: the run is killed while it waits
"""


@pytest.mark.parametrize("mode", ["bench", "profile"])
def test_bench_killed_mid_run_keeps_its_finished_rows(tmp_path, mode):
    """A run killed (SIGKILL) while its second configuration runs keeps the first one's row, in valid files:
    each row is written (atomically) the moment it is measured."""
    import signal
    import subprocess
    import sys
    import time
    (tmp_path / "hang_peer_mod.py").write_text(_HANG_PEER)
    out, mark = tmp_path / "out", tmp_path / "hanging"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               HANG_MARK=str(mark), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "ttt_zoo", "bench", "--import", "hang_peer_mod", "--model", "vit3_tiny",
            "--model-kwargs", "depth=1", "--peers", "hang_peer_tiny", "--img-size", "32", "--bench", "inference",
            "--num-warm-iter", "0", "--num-bench-iter", "1", "--device", "cpu", "--threads", "1", "--output", str(out)]
    argv += ["--profile"] if mode == "profile" else ["--results-file", str(tmp_path / "r.json")]
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        for _ in range(1200):  # the peer's child signals that it hangs (the first row is then done)
            if mark.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert mark.exists(), proc.stderr.read().decode() if proc.poll() is not None else "no hang after 120 s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and its hanging child
        proc.wait()
    if mode == "profile":
        (row,) = json.loads((out / "profile.json").read_text())["results"]
        assert row["label"] == "vit3_tiny" and row["total_ms"] > 0 and row["ops"]
        assert "## vit3_tiny @ 32x32, infer:" in (out / "profile.md").read_text()
    else:
        (row,) = json.loads((tmp_path / "r.json").read_text())["results"]
        assert row["label"] == "vit3_tiny" and row["infer_step_time"] > 0
        assert "| 32 | vit3_tiny |" in (out / "bench.md").read_text()
    assert not [p for p in os.listdir(out) if p.startswith(".tmp-")]


def test_merge_pools_the_steps_of_every_repeat_into_median_and_spread():
    """A cell is the median of the timed steps of all its repeats, with their min and max; samples/s follow from
    the same three numbers; a failed repeat is left out; an older child without ``step_times`` counts as its median."""
    from ttt_zoo.bench.run import _merge
    runs = [dict(step_time=12.0, step_times=[10.0, 12.0, 30.0], batch_size=2, peak_mem_mb=5.0),
            dict(error="child killed by SIGKILL"),
            dict(step_time=11.0, step_times=[11.0, 9.0, 50.0], batch_size=2, peak_mem_mb=7.0),
            dict(step_time=40.0, batch_size=2, peak_mem_mb=6.0)]
    m = _merge(runs)
    assert (m["step_time"], m["step_time_min"], m["step_time_max"], m["steps"]) == (12.0, 9.0, 50.0, 7)
    assert m["samples_per_sec"] == pytest.approx(2e3 / 12.0, abs=1e-3)
    assert (m["samples_per_sec_min"], m["samples_per_sec_max"]) == (pytest.approx(40.0), pytest.approx(2e3 / 9, abs=1e-3))
    assert m["peak_mem_mb"] == 6.0 and m["repeats"] == 3 and "step_times" not in m
    assert runs[0]["step_times"] == [10.0, 12.0, 30.0]  # the stored runs stay whole (rows are merged again later)


def _spread_row(label, role, ms, lo, hi):
    return dict(_row(label, role, 64, ms, 10.0), infer_step_time_min=lo, infer_step_time_max=hi)


def test_ratio_is_marked_when_the_spreads_overlap():
    """The rule: a time ratio is not meaningful when the row's and the peer's min-max step times overlap (either
    could be the faster); it is marked * in the table and said in one warning; apart, it stands unmarked."""
    from ttt_zoo.bench.report import ratio_unsettled, spread_warning
    peer = _spread_row("b", "peer", 10.0, 9.0, 11.0)
    apart = _spread_row("a", "model", 20.0, 18.0, 23.0)
    # the case: 9x slower in one run, 7x faster in another, so the ranges overlap across ratio 1
    swinging = _spread_row("a", "model", 20.0, 10.0 / 7, 90.0)
    touching = _spread_row("a", "model", 20.0, 11.0, 23.0)  # equal ends: the same step time fits both
    assert not ratio_unsettled(apart, peer, "infer") and not ratio_unsettled(peer, peer, "infer")
    assert ratio_unsettled(swinging, peer, "infer") and ratio_unsettled(touching, peer, "infer")
    assert not ratio_unsettled(_row("a", "model", 64, 20.0, 10.0), peer, "infer")  # no spread recorded: no claim
    table = format_table([apart, peer])
    assert "| 64 | a | 1 | 1.00 | 0.500 | 20.0 | 18.0-23.0 | 50.0 | 10.0 | 50.0 | 2.00x | 1.00x |" in table
    assert "| 64 | b | 1 | 1.00 | 0.500 | 10.0 | 9.00-11.0 |" in table and "*" not in table
    assert spread_warning([apart, peer]) is None
    table = format_table([swinging, peer])
    assert "| 2.00x* | 1.00x |" in table and "| 1.00x | 1.00x |" in table  # the peer's own ratio is not marked
    warning = spread_warning([swinging, peer])
    assert warning.startswith("1 time ratio(s) marked * are not meaningful")
    assert table.count("not meaningful") == 1 and warning[1:] in table  # the table's footnote says the same


def test_bench_cli_writes_the_spread_and_warns_with_injected_timings(tmp_path, monkeypatch, capsys):
    """The CLI end to end with the children's timings injected (no wall clock): the results file has timm's keys
    plus the spread columns, the table the min-max column, and overlapping spreads one ``warning:`` line."""
    import ttt_zoo.bench.run as bench_run
    times = {("vit3_tiny", "inference"): [30.0, 10.0, 20.0], ("test_vit", "inference"): [8.0, 9.0, 25.0],
             ("vit3_tiny", "train"): [60.0, 61.0, 62.0], ("test_vit", "train"): [20.0, 21.0, 22.0]}

    def fake_child(kind, spec, env=None, src=None, timeout=None):
        steps = times[(spec["model"], spec["phase"])]
        return dict(step_time=sorted(steps)[1], step_times=steps, samples_per_sec=1e3 / sorted(steps)[1],
                    batch_size=spec["batch_size"], img_size=spec["img_size"][0], param_count=1.0, peak_mem_mb=3.0,
                    threads=1, gmacs=0.1)

    monkeypatch.setattr(bench_run, "run_child", fake_child)
    monkeypatch.setattr("ttt_zoo.progress.DEFAULT_DELAY", 0.0)  # progress lines at once (else after a few seconds)
    rc = main(["bench", "--model", "vit3_tiny", "--peers", "test_vit", "--img-size", "32", "--device", "cpu",
               "--results-file", str(tmp_path / "r.csv")])
    out = capsys.readouterr()
    assert rc == 0, out
    with open(tmp_path / "r.csv") as f:
        rows = {r["model"]: r for r in csv.DictReader(f)}
    r = rows["vit3_tiny"]
    for k in ("infer_samples_per_sec", "infer_step_time", "infer_batch_size", "infer_img_size", "param_count",
              "train_samples_per_sec", "train_step_time"):
        assert k in r, k
    assert (float(r["infer_step_time"]), float(r["infer_step_time_min"]), float(r["infer_step_time_max"])) == (
        20.0, 10.0, 30.0)
    assert float(r["infer_samples_per_sec_min"]) == pytest.approx(1e3 / 30, abs=1e-3) and r["infer_steps"] == "3"
    assert "| 32 | vit3_tiny | 1 | 1.00 | 0.100 | 20.0 | 10.0-30.0 |" in out.out
    assert "| 2.22x* |" in out.out and "| 2.90x |" in out.out  # inference overlaps; training (60-62 vs 20-22) does not
    warnings = [line for line in out.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "1 time ratio(s) marked * are not meaningful" in warnings[0], out.err
    assert [line.split(" eta")[0] for line in out.err.splitlines() if line.startswith("bench [")] == [
        f"bench [{i}/4]" for i in range(1, 5)]  # the measurements done, each with the run's ETA


def test_bench_runs_a_diffusion_model_on_the_latents_of_the_image_size():
    """A DiT's --img-size is the image in pixels: it is built and run at the SD VAE's latent size (8x smaller,
    4 channels) with timesteps and labels, so its GMACs are those of forward(x, t, y) on the 64-px image's latents."""
    from torch.utils.flop_counter import FlopCounterMode
    from ttt_zoo.bench.models import _Setup, count_gmacs
    kwargs = dict(depth=1, hidden_size=64, num_heads=2)
    spec = dict(model="dit3_s_2", img_size=[64, 64], phase="train", batch_size=2, device="cpu",
                model_kwargs=kwargs)
    s = _Setup(spec)
    assert s.model.grid_size == (4, 4) and [tuple(t.shape) for t in s.inputs] == [(2, 4, 8, 8), (2,), (2,)]
    assert torch.isfinite(s.step()).all()
    ref = timm.create_model("dit3_s_2", input_size=8, **kwargs).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        ref(torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.tensor([3]))
    assert count_gmacs("dit3_s_2", (64, 64), kwargs) == pytest.approx(counter.get_total_flops() / 2e9, rel=1e-6)
    with pytest.raises(ValueError, match="not a multiple of the VAE factor 8"):
        count_gmacs("dit3_s_2", (60, 64), kwargs)


def test_readme_speed_table_is_the_results_files():
    """README.md's "Measured speed" table is what experiments/cpu_speed_table.py renders from the results files
    (regenerate and compare), every run folder's command is one of the README's commands, word for word, and the
    README says the GPU figures are pending."""
    import importlib.util
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("cpu_speed_table", os.path.join(root, "experiments",
                                                                                   "cpu_speed_table.py"))
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_docs import parse_blocks
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert table.readme_block(readme) == table.render(root), "run python experiments/cpu_speed_table.py --write"
    commands = {c.text for b in parse_blocks("README.md") for c in b.commands}
    runs = [r for r in table.RUNS if os.path.isfile(os.path.join(root, table.FOLDER, r, "bench.md"))]
    assert runs, "no run folder in experiments/results/cpu_speed_table"
    for run in runs:
        command, machine, rows = table.read_run(run, root)
        assert command in commands, (run, command)
        assert "2 cores" in machine and rows
        for r in rows:  # the cells carry their spread
            for p in ("infer", "train"):
                if r.get(f"{p}_step_time"):
                    assert float(r[f"{p}_step_time_min"]) <= float(r[f"{p}_step_time"]) <= float(
                        r[f"{p}_step_time_max"])
    assert "GPU figures are pending until they are measured" in " ".join(readme.split())
