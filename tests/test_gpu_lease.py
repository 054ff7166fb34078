"""``tools/gpu_lease.sh`` on the CPU (issue 39 item 6, issue 47 item 4): its one-line refusals before anything runs
(a missing wheel, a missing plugin wheel: also in ``--preflight``), the device stack's refusals after its versions
are written (no CUDA, a broken torch, a wheel that must be installed and cannot), its plan (every op with a kernel
verified, every family benchmarked, CUDA graphs at 224 and 1024, each call within its budget), its dry run
(``GPU_LEASE_DRY_RUN=1``) with every unit skipped by a budget of 0, and a dry run cut off (SIGTERM, then SIGKILL
after a grace) in the middle of its verify step, whose ``$OUT`` keeps every unit finished before the kill.

The cut is driven by the script's hook ``GPU_LEASE_HANG_AT=UNIT`` (that unit writes ``hanging.UNIT`` and sleeps until
killed): the test waits for the marker to reach the packed tar, so nothing depends on timing.
"""
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_lease.sh"
RECORDS = ROOT / "kernels" / "gpu_verified.json"


def _pins():
    return dict(line.split("#")[0].strip().split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line.split("#")[0])


def _wheel_files():
    """The wheel file names the script needs: the pinned three at their pins, the others at any version."""
    pins = _pins()
    names = {"timm": pins["timm"], "pytest_xdist": pins["pytest-xdist"], "pytest_timeout": pins["pytest-timeout"],
             "pytest": "9.9.9", "execnet": "9.9.9", "pluggy": "9.9.9", "iniconfig": "9.9.9", "packaging": "9.9.9",
             "pygments": "9.9.9"}
    return [f"{n}-{v}-py3-none-any.whl" for n, v in names.items()]


def _env(tmp_path, drop=(), **extra):
    """The dry run's environment: empty files named as the wheels (a run installs only what its python lacks: the
    venv lacks nothing), caches, work folder and $OUT under ``tmp_path``; ``drop``: wheel names left out."""
    wheels = tmp_path / "whl"
    wheels.mkdir(exist_ok=True)
    for name in _wheel_files():
        if not name.startswith(tuple(f"{d}-" for d in drop)):
            (wheels / name).write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GPU_LEASE_"))}
    env.update(GPU_LEASE_DRY_RUN="1", GPU_LEASE_PYTHON=sys.executable, GPU_LEASE_WHEELS=str(wheels),
               GPU_LEASE_CACHE=str(tmp_path / "cache"), OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def _run(args, env, timeout=600):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _packed(path: Path):
    """{name inside the tar: bytes} of the regular files of ``$OUT/gpu_lease.tgz`` ({} if there is none yet)."""
    if not path.is_file():
        return {}
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _summary(text):
    """{unit: status} from a summary.md."""
    return {cells[1].strip(): cells[2].strip() for cells in (row.split("|") for row in text.splitlines()[2:])}


def _one_error_line(r, *expected):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(e in lines[0] for e in expected), lines
    return lines[0]


@pytest.mark.parametrize("case", ["no_wheel", "no_plugin_wheel", "preflight_no_plugin_wheel", "bad_budget",
                                  "bad_step"])
def test_refuses_in_one_line_before_running_anything(case, tmp_path):
    args = ["60"]
    env = _env(tmp_path, drop=["pytest_timeout"] if case.endswith("no_plugin_wheel") else ())
    expected = {"no_wheel": ["no wheel of timm", "pytest-xdist", "make gpu-wheel", 'carry: [".whl"]'],
                "no_plugin_wheel": ["no wheel of pytest-timeout ", "make gpu-wheel"],
                "preflight_no_plugin_wheel": ["no wheel of pytest-timeout ", "make gpu-wheel"],
                "bad_budget": ["BUDGET_S 'soon'"], "bad_step": ["no step or unit 'benchmark'"]}[case]
    if case == "no_wheel":  # a fresh checkout: no .whl/
        env["GPU_LEASE_WHEELS"] = str(tmp_path / "none")
    elif case == "preflight_no_plugin_wheel":
        args = ["--preflight"]
    elif case == "bad_budget":
        args = ["soon"]
    else:
        args = ["60", "benchmark"]
    r = _run(args, env)
    line = _one_error_line(r, *expected)
    assert r.stdout == ""
    if case.endswith("no_plugin_wheel"):
        assert "timm" not in line and "pytest-xdist" not in line  # the wheels that are there are not named
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()  # nothing ran, nothing written


def _broken_torch(tmp_path):
    """A folder for PYTHONPATH whose ``torch`` fails to import (its metadata is still the venv's)."""
    (tmp_path / "shadow" / "torch").mkdir(parents=True)
    (tmp_path / "shadow" / "torch" / "__init__.py").write_text("raise ImportError('this torch is broken')\n")
    return str(tmp_path / "shadow")


def _old_timeout_plugin(tmp_path):
    """A folder for PYTHONPATH that makes pytest-timeout look installed at 1.0 (metadata only)."""
    info = tmp_path / "shadow" / "pytest_timeout-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pytest-timeout\nVersion: 1.0\n")
    return str(tmp_path / "shadow")


@pytest.mark.parametrize("case", ["no_cuda", "broken_torch", "install_fails"])
def test_device_stack_refusal_comes_after_its_versions_are_written(case, tmp_path):
    """The device run writes $OUT/versions.txt first (no CUDA call), installs only the wheels whose package its
    python lacks, then refuses in one line (exit 2) when the stack cannot run the steps; what it wrote comes back."""
    env = _env(tmp_path)
    if case == "no_cuda":  # the real run on a machine without a GPU
        env.update(GPU_LEASE_DRY_RUN="0", CUDA_VISIBLE_DEVICES="")
        expected = ["the stack cannot run the steps", "no CUDA device here"]
    elif case == "broken_torch":
        env["PYTHONPATH"] = _broken_torch(tmp_path)
        expected = ["the stack cannot run the steps", "this torch is broken"]
    else:  # pytest-timeout seen at 1.0: only its wheel is installed (the empty file fails)
        env["PYTHONPATH"] = _old_timeout_plugin(tmp_path)
        expected = [f"pip could not install pytest_timeout-{_pins()['pytest-timeout']}-py3-none-any.whl offline"]
    r = _run(["60"], env)
    line = _one_error_line(r, *expected)
    if case == "install_fails":
        assert "timm" not in line and "xdist" not in line
    out = tmp_path / "out"
    versions = (out / "versions.txt").read_text()
    assert versions.startswith("python ") and "torch " in versions and "triton " in versions, versions
    if case == "broken_torch":
        assert "torch import failed: ImportError: this torch is broken" in versions
    timeline = (out / "timeline.txt").read_text()
    assert timeline.index("versions (before any CUDA call)") < timeline.index("refused: "), timeline
    assert "start " not in timeline  # no unit ran
    assert "gpu_lease/versions.txt" in _packed(out / "gpu_lease.tgz")


def _plan(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_LEASE_")}
    r = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env={**env, "GPU_LEASE_PLAN": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_plan_verifies_every_registered_op_and_benchmarks_every_family():
    """``GPU_LEASE_PLAN=1``: the GPU run's units without running them (nor needing a wheel or a GPU). Independently
    of gpu_check's own check: one verification unit per kernel folder of the op registry, together every op with a
    Triton kernel; the benchmarks cover a model of each ``ttt_zoo.models`` family; CUDA graphs at 224 and 1024; the
    verification first; call 1 within 540 s. Then gpu_check's ``plan_problems`` finds nothing wrong with it and
    names what a doctored plan lacks."""
    import shlex
    from ttt_zoo.cli import build_parser
    from ttt_zoo.kernels import available_ops
    from ttt_zoo.kernels.backend import kernel_folder
    sys.modules.pop("gpu_check", None)
    from test_gpu_verification import _gpu_check
    gc = _gpu_check()
    text = _plan("540")
    header, *rows = text.splitlines()
    assert header.startswith("# plan budget=540 "), header
    units = [row.split("\t") for row in rows]
    kernel_ops = {op for op, impls in available_ops().items() if impls["triton"]}
    folders = {kernel_folder(op) for op in kernel_ops}
    steps = [u[1] for u in units]
    assert steps.index("bench_families") > max(i for i, s in enumerate(steps) if s == "verify"), steps
    verified, benched, graph_sizes, call1 = {}, set(), set(), 0
    for name, step, cap, minimum, call, cmd in units:
        argv = shlex.split(cmd)
        call1 += int(cap) if call == "1" else 0
        if argv[1] == "tools/gpu_check.py":
            args = gc.build_parser().parse_args(argv[2:])
            assert not args.dry_run, name
            if step == "verify":
                assert args.steps == ["tests", "records"], name
                verified[name] = set(args.only_ops)
            else:
                assert args.steps == ["bench"] and args.sizes == [224], name
                benched |= set(args.models) | set(gc.DIFFUSION)
            continue
        args = build_parser().parse_args(argv[argv.index("ttt_zoo") + 1:])
        if step == "kernels_json":
            assert args.command == "kernels"
            continue
        assert args.device == "cuda" and args.model == ["vit3_tiny"] and args.peers == ["deit_tiny_patch16_224"]
        if step == "graphs":
            assert args.runtime == ["compile"] and args.torchcompile_mode == "reduce-overhead", name
            graph_sizes |= {h for h, w in args.img_size}
    assert set(verified) == {f"verify_{f}" for f in folders}, verified
    assert set().union(*verified.values()) == kernel_ops
    for op in ("ttt_linear", "ttt_linear_bidir", "t5_swiglu_ttt", "key_instance_norm", "dit5_mlp_ttt",
               "vit3_variant_qkv_ttt", "linear_attention", "vit3_swiglu_ttt"):  # issue 47's list, by name
        assert op in kernel_ops
    import timm
    families = {"vit3", "hvit3", "visionttt", "t5", "dit3", "dit5"}
    assert families <= set(gc.model_families()), gc.model_families()
    for family in gc.model_families():
        assert benched & set(timm.list_models(module=family)), family
    assert graph_sizes == {224, 1024}
    assert 30 + call1 <= 540 - 15  # setup and reserve
    assert gc.plan_problems(text) == []
    lacking_key_norm = "\n".join(line for line in text.splitlines() if not line.startswith("verify_key_norm\t"))
    assert gc.plan_problems(lacking_key_norm) == ["no verification unit for key_instance_norm"]
    lacking_1024 = "\n".join(line for line in text.splitlines() if not line.startswith("graphs_1024\t"))
    assert gc.plan_problems(lacking_1024) == ["the CUDA-graph step lacks [1024] px"]
    no_bench = "\n".join(line for line in text.splitlines() if "\tbench_families\t" not in line)
    # every family but ViT3 (in the graphs and profile units) lacks its benchmark
    assert [p.split()[4] for p in gc.plan_problems(no_bench)] == sorted(set(gc.model_families()) - {"vit3"})
    # units chosen by name or step: only those
    assert [r.split("\t")[0] for r in _plan("540", "verify_key_norm", "graphs").splitlines()[1:]] == [
        "verify_key_norm", "graphs_224", "graphs_1024"]


def test_preflight_says_ready_in_one_line(tmp_path):
    r = _run(["--preflight"], _env(tmp_path))
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert r.stdout.startswith("pre-flight: ready: ") and len(r.stdout.splitlines()) == 1, r.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_dry_run_with_no_budget_skips_every_unit_in_one_line(tmp_path):
    r = _run(["0"], _env(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    files = _packed(out / "gpu_lease.tgz")
    summary = _summary(files["gpu_lease/summary.md"].decode())
    assert {"verify_vit3_ttt", "verify_ttt_linear", "verify_inner_mlp", "verify_key_norm", "verify_linear_attention",
            "bench_families", "profile"} <= set(summary), summary
    assert set(summary.values()) == {"skipped"}, summary
    skips = [line for line in r.stdout.splitlines() if "] skip " in line]
    assert sorted(line.split("] skip ")[1].split(":")[0] for line in skips) == sorted(summary), r.stdout
    assert all("it needs at least" in line for line in skips)
    for step in ("kernels_json", "verify", "bench_families", "graphs", "profile"):
        assert f"] step {step} (" in r.stdout, r.stdout
    assert f"timm {_pins()['timm']}" in (out / "versions.txt").read_text()
    assert (out / "timeline.txt").read_text() == files["gpu_lease/timeline.txt"].decode()
    assert (out / "summary.md").read_text() == files["gpu_lease/summary.md"].decode()


def test_dry_run_cut_off_mid_step_keeps_every_finished_result(tmp_path):
    """Killed in the verify step (its second unit hanging): $OUT holds the first unit's verification and record,
    already before the kill (written after each unit and every second while one runs) and after it (the SIGTERM
    trap's pack). A --resume call on the same cache then skips the unit that ran to its end."""
    from ttt_zoo.kernels.backend import kernel_source_hash
    repo_records = RECORDS.read_bytes()
    hang = "verify_linear_attention"
    out = tmp_path / "out"
    tgz = out / "gpu_lease.tgz"
    log = tmp_path / "stdout.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(SCRIPT), "900", "verify_key_norm", hang, "profile"], cwd=ROOT,
                                start_new_session=True, stdout=f, stderr=subprocess.STDOUT,
                                env=_env(tmp_path, GPU_LEASE_HANG_AT=hang, GPU_LEASE_PACK_EVERY="1"))
    try:
        for _ in range(3000):  # a hang guard only: the marker comes after the unit before it
            if proc.poll() is not None or f"gpu_lease/hanging.{hang}" in _packed(tgz):
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the hook:\n{log.read_text()}"
        before_kill = _packed(tgz)
        summary_before = (out / "summary.md").read_text()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the grace is over: whatever is left of the run
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()
    after = _packed(tgz)
    assert _summary(summary_before) == {"verify_key_norm": "passed"}
    for files in (before_kill, after):
        assert _summary(files["gpu_lease/summary.md"].decode())["verify_key_norm"] == "passed"
        for f in ("test_op_key_norm", "test_kernels_cuda"):
            assert f"gpu_lease/verify_key_norm/tests/{f}.xml" in files, sorted(files)
            assert f"gpu_lease/verify_key_norm/tests/{f}.collected" in files, sorted(files)
        records = json.loads(files["gpu_lease/gpu_verified.json"])
        assert [r["op"] for r in records] == ["key_instance_norm"], records
        assert records[0]["sha256"] == kernel_source_hash("key_instance_norm") and "dry run" in records[0]["gpu"]
        assert not any(name.startswith(f"gpu_lease/{hang}/") for name in files)  # the hanging unit made nothing
        assert not any(name.startswith("gpu_lease/profile") for name in files)  # never reached
    assert "stopped" not in before_kill["gpu_lease/timeline.txt"].decode()
    assert f"stopped by SIGTERM during {hang}" in after["gpu_lease/timeline.txt"].decode()
    assert _summary((out / "summary.md").read_text())[hang] == "stopped by SIGTERM"
    assert not [p.name for p in out.iterdir() if p.name.endswith(".part")]
    assert RECORDS.read_bytes() == repo_records  # the dry run never writes the repository's records
    # the second call: what ran to its end is not run again; the rest waits for budget (0 here)
    r = _run(["--resume", "0", "verify_key_norm", hang], _env(tmp_path, OUT=str(tmp_path / "out2")))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _summary((tmp_path / "out2" / "summary.md").read_text()) == {
        "verify_key_norm": "done in an earlier call", hang: "skipped"}
