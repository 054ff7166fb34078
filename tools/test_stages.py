"""Run the test stages of `make test` and print one summary: wall time, pass/fail/skip counts per stage, every skip
reason with its count, and the 10 slowest tests.  The same summary goes to ``.cache/test-times.txt``.

    python tools/test_stages.py [--stages main,kernels,...] [--jobs 2] [-- extra pytest args]

Every stage runs, even after one fails, so one run shows every failure; the exit code is non-zero if any stage
failed.  A skip caused by a missing fixture, package or checkout (CI has ``../shared`` and every package) counts as
a failure: see ``FORBIDDEN_SKIPS``.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT_DIR = os.path.join(ROOT, ".cache", "test-reports")
TIMES_FILE = os.path.join(ROOT, ".cache", "test-times.txt")
# skip reasons that mean the environment is incomplete, not that the test does not apply: failures in `make test`
FORBIDDEN_SKIPS = re.compile(r"could not import|not installed|No module named|fixture .* not available|"
                             r"not a git checkout|make openmmlab", re.I)


STAGE_NAMES = ("main", "kernels", "compile", "mm", "timm")
TIMM_ONNX = "tests/test_timm_onnx_export.py"  # the timm stage's, not main's


@dataclass
class Stage:
    name: str
    what: str
    commands: List[List[str]]  # one pytest process each
    env: Dict[str, str] = field(default_factory=dict)
    cwd: str = ROOT


@dataclass
class Result:
    stage: str
    wall: float = 0.0
    rc: int = 0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    tests: List = field(default_factory=list)  # (seconds, nodeid)
    skips: collections.Counter = field(default_factory=collections.Counter)
    failures: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.failures


def kernel_files(py: str) -> List[str]:
    """The test files holding `triton` tests (decorated, or parametrised with the Triton backend: tests/conftest.py),
    from pytest's own collection with the interpreter on, so no kernel test can miss the stage."""
    r = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "triton", "tests",
                        "--ignore=tests/test_mm_adapters.py"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", TRITON_INTERPRET="1"))
    if r.returncode not in (0, 5):
        raise RuntimeError(f"collecting the triton tests failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return sorted({line.split("::")[0] for line in r.stdout.splitlines() if "::" in line})


def stages(py: str, jobs: int, extra: Sequence[str], wanted: Sequence[str] = STAGE_NAMES) -> List[Stage]:
    base = {"HF_HUB_OFFLINE": "1"}
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    xdist = ["-n", str(jobs)] if jobs > 1 else []
    # the workers share the cores: torch's default of every core per worker oversubscribed them, and OpenMP's
    # spinning threads then ran the numerics file ~9x slower (427 s vs 49 s on 2 workers, 2 cores)
    par = dict(base, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // max(jobs, 1))))
    return [
        Stage("main", "unit, parity and numerics tests (no Triton interpreter, no compile, no OpenMMLab)",
              [pytest + xdist + ["tests", "--ignore=tests/test_mm_adapters.py", f"--ignore={TIMM_ONNX}",
                                 "-m", "not compile and not triton", *extra]], dict(par, TRITON_INTERPRET="0")),
        # one pytest process per file: in xdist workers shared with other files the interpreter's custom-op calls
        # crashed (SIGSEGV, `vector::reserve` errors from the dispatcher)
        Stage("kernels", "Triton kernels in the interpreter (marker `triton`), one process per file",
              [pytest + xdist + [f, "-m", "triton", *extra] for f in (kernel_files(py) if "kernels" in wanted else [])],
              dict(par, TRITON_INTERPRET="1")),
        Stage("compile", "whole-model torch.compile (inductor), one family per test",
              [pytest + xdist + ["-m", "compile", "tests/test_compile.py", *extra]],
              dict(par, TRITON_INTERPRET="0", TORCHINDUCTOR_CACHE_DIR="{tmp}")),
        Stage("mm", "mmdet / mmseg adapters and smoke training (own process: mmengine's Runner)",
              [pytest + ["tests/test_mm_adapters.py", *extra]], base),
        # timm's export (onnx_export.py's two calls) on every classifier code path with both exporters: a dynamo
        # export takes tens of seconds, so it runs beside timm's own tests rather than in main
        Stage("timm", "timm's own tests/test_models.py on our models, and timm's ONNX export (both exporters)",
              [pytest + xdist + ["test_models.py", *extra],
               pytest + xdist + [os.path.join(ROOT, TIMM_ONNX), "--rootdir", ROOT, *extra]],
              par, cwd=os.path.join(ROOT, "tools", "timm_suite")),
    ]


def _parse(xml_path: str, res: Result, cwd: str) -> None:
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        nodeid = (cls.replace(".", "/") + ".py::" + name) if cls else name
        res.tests.append((float(case.get("time") or 0), nodeid))
        fail = case.find("failure")
        err = case.find("error")
        skip = case.find("skipped")
        if fail is not None or err is not None:
            (res.__setattr__("failed", res.failed + 1) if fail is not None else
             res.__setattr__("errors", res.errors + 1))
            el = fail if fail is not None else err
            res.failures.append(f"{nodeid}: {(el.get('message') or '').splitlines()[0][:200] if el.get('message') else ''}")
        elif skip is not None:
            reason = (skip.get("message") or "").strip()
            reason = re.sub(r"^Skipped: ", "", reason)
            res.skipped += 1
            res.skips[reason] += 1
            if FORBIDDEN_SKIPS.search(reason):
                res.failures.append(f"{nodeid}: skipped for a missing dependency in a full run: {reason}")
        else:
            res.passed += 1


def run_stage(stage: Stage, log=print) -> Result:
    res = Result(stage.name)
    os.makedirs(REPORT_DIR, exist_ok=True)
    t0 = time.monotonic()
    for i, cmd in enumerate(stage.commands):
        tmp = tempfile.mkdtemp(prefix=f"ttt_zoo_{stage.name}_")
        xml = os.path.join(REPORT_DIR, f"{stage.name}-{i}.xml")
        if os.path.exists(xml):
            os.remove(xml)
        env = dict(os.environ, **{k: v.format(tmp=tmp) for k, v in stage.env.items()})
        full = cmd + [f"--junitxml={xml}", "-o", "junit_family=xunit1"]
        log(f"== [{stage.name}] {' '.join(c for c in cmd[1:])}")
        try:
            rc = subprocess.call(full, env=env, cwd=stage.cwd)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if rc not in (0, 5):  # 5: nothing collected (a file whose tests all belong to another stage)
            res.rc = rc
        if os.path.exists(xml):
            _parse(xml, res, stage.cwd)
        elif rc not in (0, 5):
            res.failures.append(f"{' '.join(cmd[3:])}: pytest exited {rc} without a report")
    res.wall = time.monotonic() - t0
    return res


def summary(results: Sequence[Result], total: float) -> str:
    lines = ["", "=" * 100, "Test stages (wall time, counts)", "",
             f"| {'stage':<8} | {'wall':>8} | {'passed':>6} | {'failed':>6} | {'errors':>6} | {'skipped':>7} | status |",
             f"|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 8}|{'-' * 8}|{'-' * 9}|--------|"]
    for r in results:
        lines.append(f"| {r.stage:<8} | {r.wall / 60:6.1f} m | {r.passed:>6} | {r.failed:>6} | {r.errors:>6} | "
                     f"{r.skipped:>7} | {'ok' if r.ok else 'FAILED'} |")
    lines.append(f"| {'total':<8} | {total / 60:6.1f} m | {sum(r.passed for r in results):>6} | "
                 f"{sum(r.failed for r in results):>6} | {sum(r.errors for r in results):>6} | "
                 f"{sum(r.skipped for r in results):>7} | {'ok' if all(r.ok for r in results) else 'FAILED'} |")
    skips = collections.Counter()
    for r in results:
        for reason, n in r.skips.items():
            skips[(r.stage, reason)] += n
    lines += ["", "Skips (stage: count x reason):"]
    lines += [f"  {stage}: {n} x {reason}" for (stage, reason), n in sorted(skips.items())] or ["  none"]
    slow = sorted(((t, f"[{r.stage}] {n}") for r in results for t, n in r.tests), reverse=True)[:10]
    lines += ["", "10 slowest tests:"] + [f"  {t:8.1f} s  {n}" for t, n in slow]
    files = collections.Counter()
    for r in results:
        for t, n in r.tests:
            files[f"[{r.stage}] {n.split('::')[0]}"] += t
    lines += ["", "10 slowest test files (summed test time; over 2 workers the wall time is about half):"]
    lines += [f"  {t:8.1f} s  {n}" for n, t in files.most_common(10)]
    fails = [f for r in results for f in r.failures]
    if fails:
        lines += ["", "Failures:"] + [f"  {f}" for f in fails]
    return "\n".join(lines) + "\n"


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default=",".join(STAGE_NAMES))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in wanted if s not in STAGE_NAMES]
    if bad:
        print(f"error: unknown stage(s) {bad}; choose from {','.join(STAGE_NAMES)}", file=sys.stderr)
        return 2
    known = {s.name: s for s in stages(args.python, args.jobs, extra, wanted)}
    t0 = time.monotonic()
    results = [run_stage(known[s]) for s in wanted]
    text = summary(results, time.monotonic() - t0)
    text += f"\n(written {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs)\n"
    print(text)
    _write_atomic(TIMES_FILE, text)
    print(f"wrote {os.path.relpath(TIMES_FILE, ROOT)}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
