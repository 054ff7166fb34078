"""``tools/gpu_lease.sh`` on the CPU (issue 39 item 6): its one-line refusals before anything runs, its dry run
(``GPU_LEASE_DRY_RUN=1``) with every unit skipped by a budget of 0, and a dry run cut off (SIGTERM, then SIGKILL
after a grace) in the middle of its last step, whose ``$OUT/gpu_lease.tgz`` keeps every unit finished before the
kill: the op verification with its record, the benchmark rows, the profile.

The cut is driven by the script's hook ``GPU_LEASE_HANG_AT=UNIT`` (that unit writes ``hanging.UNIT`` and sleeps until
killed): the test waits for the marker to reach the packed tar, so nothing depends on timing.
"""
import csv
import io
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
TIMM = next(line.split("==")[1].split()[0] for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.startswith("timm=="))
VIT3_OPS = {"vit3_swiglu_ttt", "vit3_dwconv_ttt", "vit3_qkv_ttt"}


def _env(tmp_path, **extra):
    """The dry run's environment: a wheel of the pinned name (the dry run checks it is there and installs nothing),
    caches, work folder and $OUT under ``tmp_path``."""
    wheels = tmp_path / "whl"
    wheels.mkdir(exist_ok=True)
    (wheels / f"timm-{TIMM}-py3-none-any.whl").write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GPU_LEASE_"))}
    env.update(GPU_LEASE_DRY_RUN="1", GPU_LEASE_PYTHON=sys.executable, GPU_LEASE_WHEELS=str(wheels),
               GPU_LEASE_CACHE=str(tmp_path / "cache"), OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def _packed(path: Path):
    """{name inside the tar: bytes} of the regular files of ``$OUT/gpu_lease.tgz`` ({} if there is none yet)."""
    if not path.is_file():
        return {}
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _summary(files):
    """{unit: status} from the packed summary.md."""
    rows = files["gpu_lease/summary.md"].decode().splitlines()[2:]
    return {cells[1].strip(): cells[2].strip() for cells in (row.split("|") for row in rows)}


def _wrapper_without_site_packages(tmp_path):
    """A python3 that cannot import torch (no site-packages): the package is not importable."""
    path = tmp_path / "python3"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("case", ["no_wheel", "no_cuda", "not_importable", "bad_budget", "bad_step"])
def test_refuses_in_one_line_before_running_anything(case, tmp_path):
    env, args = _env(tmp_path), ["60"]
    expected = {"no_wheel": "make gpu-wheel", "no_cuda": "no CUDA device", "not_importable": "No module named 'torch'",
                "bad_budget": "BUDGET_S 'soon'", "bad_step": "no step 'benchmark'"}[case]
    if case == "no_wheel":  # a fresh checkout: no .whl/
        env["GPU_LEASE_WHEELS"] = str(tmp_path / "none")
    elif case == "no_cuda":  # the real run on a machine without a GPU; nothing is installed before this check
        env.update(GPU_LEASE_DRY_RUN="0", CUDA_VISIBLE_DEVICES="")
    elif case == "not_importable":
        env["GPU_LEASE_PYTHON"] = _wrapper_without_site_packages(tmp_path)
    elif case == "bad_budget":
        args = ["soon"]
    else:
        args = ["60", "benchmark"]
    r = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    if case == "no_wheel":
        assert 'carry: [".whl"]' in lines[0]
    assert not (tmp_path / "out").exists()  # nothing ran, nothing packed
    if case != "not_importable":
        assert not (tmp_path / "cache").exists()


def test_dry_run_with_no_budget_skips_every_unit_in_one_line(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "0"], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    files = _packed(tmp_path / "out" / "gpu_lease.tgz")
    summary = _summary(files)
    assert {"verify_vit3", "eager_32_train", "profile", "verify_ttt_linear"} <= set(summary), summary
    assert set(summary.values()) == {"skipped"}, summary
    skips = [line for line in r.stdout.splitlines() if "] skip " in line]
    assert sorted(line.split("] skip ")[1].split(":")[0] for line in skips) == sorted(summary), r.stdout
    assert all("it needs at least" in line for line in skips)
    for step in ("verify_vit3", "bench_eager", "bench_graphs", "profile", "verify_others"):
        assert f"] step {step} (" in r.stdout, r.stdout
    assert b"timm " + TIMM.encode() in files["gpu_lease/versions.txt"]
    assert (tmp_path / "out" / "timeline.txt").read_text() == files["gpu_lease/timeline.txt"].decode()


def test_plan_of_the_gpu_run_parses_and_verifies_every_kernel_op():
    """``GPU_LEASE_PLAN=1``: the GPU run's units without running them (nor needing a wheel or a GPU). Every
    command parses with its tool's own parser, the steps come in the issue's order, ViT3-T meets DeiT-T eager and
    under CUDA graphs at each size, and every op with a kernel is verified by some unit."""
    import shlex
    from ttt_zoo.cli import build_parser
    from ttt_zoo.kernels import available_ops
    sys.modules.pop("gpu_check", None)
    from test_gpu_verification import _gpu_check
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_LEASE_")}
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env={**env, "GPU_LEASE_PLAN": "1"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    units = [line.split("\t") for line in r.stdout.splitlines() if "\t" in line]
    names = [u[0] for u in units]
    assert names[0] == "verify_vit3" and names.index("profile") > names.index("graphs_2048_both") \
        > names.index("eager_2048_both"), names
    gc, verified, sizes = _gpu_check().build_parser(), set(), {}
    for name, cap, minimum, cmd in units:
        assert 0 < int(minimum) <= int(cap), name
        argv = shlex.split(cmd)
        if argv[1] == "tools/gpu_check.py":
            args = gc.parse_args(argv[2:])
            assert args.steps == ["tests", "records"] and not args.dry_run, name
            verified |= set(args.only_ops)
            continue
        assert argv[1:4] == ["-m", "ttt_zoo", "bench"], name
        args = build_parser().parse_args(argv[3:])
        assert args.device == "cuda" and args.model == ["vit3_tiny"] and args.backend == ["triton"], name
        if name != "profile":
            assert args.peers == ["deit_tiny_patch16_224"] and not args.profile, name
            graphs = args.runtime == ["compile"] and args.torchcompile_mode == "reduce-overhead"
            assert graphs or args.runtime == ["torch"], name
            sizes.setdefault(graphs, []).append((args.img_size, args.bench))
    expected = [([(224, 224)], "train"), ([(512, 512)], "train"), ([(1248, 1248)], "inference"),
                ([(2048, 2048)], "both")]
    assert sizes == {False: expected, True: expected}, sizes
    assert verified == {op for op, impls in available_ops().items() if impls["triton"]}, verified


def test_dry_run_cut_off_mid_step_keeps_every_finished_row(tmp_path):
    """Killed in its last step (verify_others, its first unit hanging): the tar holds the ViT3 op verification and
    its record, the benchmark rows and the profile, already before the kill (packed after each unit and every
    second while one runs) and after it (the SIGTERM trap's pack)."""
    from ttt_zoo.kernels.backend import kernel_source_hash
    repo_records = RECORDS.read_bytes()
    hang = "verify_ttt_linear"
    tgz = tmp_path / "out" / "gpu_lease.tgz"
    log = tmp_path / "stdout.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(SCRIPT), "900"], cwd=ROOT, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT,
                                env=_env(tmp_path, GPU_LEASE_HANG_AT=hang, GPU_LEASE_PACK_EVERY="1"))
    try:
        for _ in range(3000):  # a hang guard only: the marker comes after the three steps before it
            if proc.poll() is not None or f"gpu_lease/hanging.{hang}" in _packed(tgz):
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the hook:\n{log.read_text()}"
        before_kill = _packed(tgz)
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
    for files in (before_kill, after):
        summary = _summary(files)
        assert {u: summary[u] for u in ("verify_vit3", "eager_32_train", "profile")} == dict.fromkeys(
            ("verify_vit3", "eager_32_train", "profile"), "passed"), summary
        # the ViT3 op verification: each file's results and what it collected, and the records of the ops whose
        # collected cuda cases all passed (the dry run runs the first case of each file)
        for f in ("test_op_vit3_ttt", "test_kernels_cuda"):
            assert f"gpu_lease/verify_vit3/tests/{f}.xml" in files and f"gpu_lease/verify_vit3/tests/{f}.collected" \
                in files, sorted(files)
        records = json.loads(files["gpu_lease/gpu_verified.json"])
        assert records and {r["op"] for r in records} <= VIT3_OPS, records
        assert all(r["sha256"] == kernel_source_hash(r["op"]) and "dry run" in r["gpu"] for r in records)
        collected = files["gpu_lease/verify_vit3/tests/test_kernels_cuda.collected"].decode().split()
        assert {r["op"] for r in records} == {op for op in VIT3_OPS if any(f"[{op}-" in c for c in collected)}
        # the benchmark rows, ViT3-T and DeiT-T, and the profile's
        rows = list(csv.DictReader(io.StringIO(files["gpu_lease/eager_32_train/results.csv"].decode())))
        assert sorted(r["label"] for r in rows) == ["deit_tiny_patch16_224", "vit3_tiny"], rows
        assert all(float(r["train_step_time"]) > 0 for r in rows)
        (profile,) = json.loads(files["gpu_lease/profile/profile.json"])["results"]
        assert profile["label"] == "vit3_tiny" and profile["total_ms"] > 0
        assert not any(name.startswith(f"gpu_lease/{hang}/") for name in files)  # the hanging unit made nothing
    assert "stopped" not in before_kill["gpu_lease/timeline.txt"].decode()
    assert f"stopped by SIGTERM during {hang}" in after["gpu_lease/timeline.txt"].decode()
    assert _summary(after)[hang] == "stopped by SIGTERM"
    assert not [p.name for p in (tmp_path / "out").iterdir() if p.name.endswith(".part")]
    assert RECORDS.read_bytes() == repo_records  # the dry run never writes the repository's records
