"""The CPU side of a GPU lease with ``tools/gpu_lease.sh``, end to end: its pre-flight, its plan, its dry run to the
end, and a dry run cut off by SIGTERM in the middle of its verify step (``GPU_LEASE_HANG_AT``: one unit sleeps until
killed; SIGKILL after a 60 s grace), each with what its ``$OUT`` holds -> ``results/gpu_lease_dry_run.md``.

    python experiments/gpu_lease_dry_run.py [--hang-at UNIT] [--out FILE]   # default: verify_linear_attention

The wheels are the real ones of ``.whl/`` (``make gpu-wheel``) where they are there, else empty files of their names.
"""
import argparse
import csv
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_lease.sh"


def _packed(path: Path):
    if not path.is_file():
        return {}
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def wheels(tmp: Path):
    """The wheels folder: .whl/ when it has every wheel, else empty files of their names (the dry run installs
    nothing where the venv has every package)."""
    specs = subprocess.run(["bash", str(SCRIPT), "--wheel-specs"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "GPU_LEASE_PYTHON": sys.executable}, check=True).stdout.split()
    files = [f"{name.replace('-', '_')}-{version}-py3-none-any.whl" for name, version in (s.split("==") for s in specs)]
    if all((ROOT / ".whl" / f).is_file() for f in files):
        return ROOT / ".whl"
    (tmp / "whl").mkdir(parents=True, exist_ok=True)
    for f in files:
        (tmp / "whl" / f).write_bytes(b"")
    return tmp / "whl"


def _env(tmp: Path, wheel_dir: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_LEASE_")}
    env.update(GPU_LEASE_DRY_RUN="1", GPU_LEASE_PYTHON=sys.executable, GPU_LEASE_WHEELS=str(wheel_dir),
               GPU_LEASE_CACHE=str(tmp / "cache"), OUT=str(tmp / "out"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               GPU_LEASE_PACK_EVERY="1")
    return env


def run(tmp: Path, wheel_dir: Path, args, hang_at=None):
    """(exit status, stdout, {name: bytes} of the tar, {name: text} of $OUT's other files) of one dry run; with
    ``hang_at``, SIGTERM once that unit's marker is packed."""
    env = _env(tmp, wheel_dir)
    if hang_at:
        env["GPU_LEASE_HANG_AT"] = hang_at
    tgz, log = tmp / "out" / "gpu_lease.tgz", tmp / "stdout.txt"
    tmp.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while hang_at and proc.poll() is None and f"gpu_lease/hanging.{hang_at}" not in _packed(tgz):
            time.sleep(0.5)
        if proc.poll() is None and hang_at:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60 if hang_at else None)
        except subprocess.TimeoutExpired:
            pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    outside = {p.name: p.read_text() for p in sorted((tmp / "out").iterdir()) if p.suffix in (".md", ".txt")}
    return proc.returncode, log.read_text(), _packed(tgz), outside


def section(title, cmd, rc, stdout, files, outside):
    lines = [f"## {title}", "", f"`{cmd}`: exit status {rc}.", "", "Its stdout (the timeline):", "", "```",
             stdout.rstrip(), "```", "", f"`$OUT` holds {', '.join(f'`{n}`' for n in outside)} and `gpu_lease.tgz`, "
             f"which holds {len(files)} files:", "", "```"]
    lines += sorted(files) + ["```", ""]
    lines += ["`$OUT/versions.txt` (written before anything else):", "", "```", outside["versions.txt"].rstrip(),
              "```", "", "`$OUT/summary.md`:", "", outside["summary.md"].rstrip(), ""]
    for row in outside["summary.md"].splitlines()[2:]:  # a failed unit: the end of its log
        unit, status = (c.strip() for c in row.split("|")[1:3])
        log = files.get(f"gpu_lease/{unit}.log", b"").decode(errors="replace").rstrip().splitlines()
        if status.startswith("failed") and log:
            lines += [f"The end of `gpu_lease/{unit}.log` ({status}):", "", "```", *[x[:300] for x in log[-8:]],
                      "```", ""]
    for name in sorted(files):
        if name.endswith("/results.csv"):
            rows = list(csv.DictReader(io.StringIO(files[name].decode())))
            lines += [f"Rows of `{name}`: " + "; ".join(
                f"{r['label']} {r['img_size']} px" + "".join(
                    f" {k.split('_')[0]} {float(r[k]):.1f} ms" for k in ("infer_step_time", "train_step_time")
                    if r.get(k)) for r in rows), ""]
        if name.endswith("/profile.json"):
            lines += [f"Rows of `{name}`: " + "; ".join(
                f"{r['label']} {r['img_size']} {r['phase']} {r['total_ms']:.1f} ms"
                for r in json.loads(files[name])["results"]), ""]
    if "gpu_lease/gpu_verified.json" in files:
        recs = json.loads(files["gpu_lease/gpu_verified.json"])
        lines += ["Records (`gpu_lease/gpu_verified.json`): " + ", ".join(f"`{r['op']}`" for r in recs), ""]
    return lines


def _cpu(cmd, env, title, note=""):
    """A CPU-side command of the lease (pre-flight, plan): its exit status and output as a section."""
    t0 = time.time()
    r = subprocess.run(["bash", str(SCRIPT), *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    shown = "bash tools/gpu_lease.sh " + " ".join(cmd)
    return [f"## {title}", "", f"`{'GPU_LEASE_PLAN=1 ' if env.get('GPU_LEASE_PLAN') else ''}{shown}`: exit status "
            f"{r.returncode}, {time.time() - t0:.0f} s on the CPU.{note}", "", "```", (r.stdout + r.stderr).rstrip(),
            "```", ""]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hang-at", default="verify_linear_attention", help="the unit the cut-off run is killed in")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "gpu_lease_dry_run.md"))
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    env_cmd = "GPU_LEASE_DRY_RUN=1 GPU_LEASE_WHEELS=... GPU_LEASE_CACHE=... OUT=... bash tools/gpu_lease.sh"
    text = [f"<!-- generated by experiments/gpu_lease_dry_run.py at commit {commit} (working tree) -->",
            "# tools/gpu_lease.sh: its CPU side end to end (pre-flight, plan, dry run to the end and cut off)", "",
            "The dry run is the GPU run's control flow on the CPU: the same wheel and stack checks (versions first, "
            "nothing installed where the venv has every package), steps, caps (10x), writes into `$OUT` and records "
            "rule; `kernels --verify --json` on the CPU in float32, gpu_check runs the first selected case of each "
            "test file in the Triton interpreter, its tiny benchmark, a tiny profile, no CUDA graphs. Each unit's "
            "status is what this working tree gave (a unit failing is the script reporting it, not losing it).", ""]
    with tempfile.TemporaryDirectory() as tmp:
        wheel_dir = wheels(Path(tmp))
        real = wheel_dir == ROOT / ".whl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_LEASE_")}
        env.update(GPU_LEASE_PYTHON=sys.executable, GPU_LEASE_WHEELS=str(wheel_dir))
        text += _cpu(["--preflight"], env, "Pre-flight",
                     f" Wheels: {'the real ones of `.whl/`' if real else 'empty files of their names'}.")
        text += _cpu(["540"], {**env, "GPU_LEASE_PLAN": "1"}, "The plan of call 1 (540 s) and call 2 (170 s)")
        rc, out, files, outside = run(Path(tmp) / "full", wheel_dir, ["3000"])
        text += section("To its end", f"{env_cmd} 3000", rc, out, files, outside)
        units = ["verify_key_norm", args.hang_at, "profile"]
        rc, out, files, outside = run(Path(tmp) / "cut", wheel_dir, ["3000", *units], args.hang_at)
        text += section(f"Cut off by SIGTERM in the middle of its verify step (unit `{args.hang_at}` hanging)",
                        f"GPU_LEASE_HANG_AT={args.hang_at} {env_cmd} 3000 {' '.join(units)}", rc, out, files,
                        outside)
    Path(args.out).write_text("\n".join(text) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
