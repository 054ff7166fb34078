"""The GPU run in one command (``make gpu-check``): verify, time and profile the kernels, then record what passed.

    python tools/gpu_check.py --output gpu_check_out            # on a CUDA machine, about 20 minutes
    python tools/gpu_check.py --dry-run --output /tmp/gc         # the same path on the CPU, tiny, about a minute

Steps, each writing into its own folder of ``--output`` (``summary.md`` lists them with their command and status):
1. ``tests``: every kernel test file (the files that name Triton, one pytest process each, as ``make test-kernels``)
   on CUDA (``tests/_ops.py`` picks CUDA when there is one; ``TRITON_INTERPRET=0``: real compilation), then
   ``tests/test_kernels_cuda.py`` (marker ``cuda``: fp32/fp16/bf16, large head dims, N of 20000, non-contiguous
   inputs, every launch-config class);
2. ``bench_classification`` / ``bench_diffusion``: ``ttt-zoo bench`` of every family against DeiT-T (timm SDPA) at
   224..2048 px, and of DiT3/DiT5-S/2 against DiT-S/2 on the latents of 224..2048 px images (28..256), inference and
   training, bf16 autocast;
3. ``profile``: ``ttt-zoo bench --profile`` of ViT3-T training at 224 and 2048 (DeiT-T alongside);
4. ``records``: a GPU verification record (``kernels/gpu_verified.json``, see ``kernels/backend.py``) for every op
   whose folder's test file ran to the end and passed and every collected ``cuda`` case of which ran and passed
   (``tools/pytest_collected.py`` lists what each file collected before it runs).

``--dry-run``: the CPU, Triton in the interpreter, a tiny subset (one op's tests, one model and peer at 32 px), and
records written into the output folder, never the repository's file.  Also imported by ``ttt-zoo bench --import
gpu_check`` (with ``tools`` on ``PYTHONPATH``): it registers ``gpucheck_<dit model>``, DiT models that take an
image only (fixed timesteps and labels), so that the benchmark can run them.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CUDA_TESTS = TESTS / "test_kernels_cuda.py"
CLASSIFIERS = ["vit3_tiny", "hvit3_tiny", "visionttt_tiny", "visionttt_h_tiny", "t5_tiny"]
DIFFUSION = ["dit3_s_2", "dit5_s_2"]
DIT_PEER = "dit_s_2"
SIZES = [224, 512, 1024, 2048]
LATENTS = [28, 64, 128, 256]  # 224..2048 px images through the 8x VAE: the same tokens at patch 2 as at patch 16
WRAPPED = "gpucheck_"  # prefix of the image-only DiT models this module registers
DRY_RUN_TESTS = "kernels and fp32"  # the dry run: the fp32 kernel cases of the op's test file
# --first N: the first N of the op file's interpreter cases, torch.compile and meta-device ones left out (every op
# file has such cases; the test names differ from file to file)
DRY_RUN_FIRST = ["-m", "triton", "-k", "not compile and not meta_device"]


# ------------------------------------------------------------------------ image-only DiT models for ttt-zoo bench
def _register_dit_wrappers():
    import torch
    import timm
    from timm.models import register_model

    class ImageOnly(torch.nn.Module):
        """A DiT called with an image only: timestep 500 and label 0 for every sample."""

        def __init__(self, name, img_size=None, **kwargs):
            super().__init__()
            size = tuple(img_size) if img_size is not None else None
            self.dit = timm.create_model(name, **kwargs, **({"input_size": size} if size else {}))
            self.in_chans, self.num_classes = self.dit.in_chans, 0

        def forward(self, x):
            t = torch.full((x.shape[0],), 500, device=x.device)
            return self.dit(x, t, torch.zeros(x.shape[0], dtype=torch.long, device=x.device))

    import ttt_zoo  # noqa: F401  (registers the DiT models)
    for name in DIFFUSION + [DIT_PEER]:
        def make(pretrained=False, _name=name, **kwargs):
            return ImageOnly(_name, **kwargs)
        make.__name__ = make.__qualname__ = WRAPPED + name
        if WRAPPED + name not in timm.list_models(WRAPPED + name):
            register_model(make)


if __name__ != "__main__":
    _register_dit_wrappers()


# --------------------------------------------------------------------------------------------------- the steps
def _run(cmd, out_dir: Path, log_name: str, env=None, timeout=None):
    """Run ``cmd`` with its output in ``out_dir/log_name``; (return code, seconds)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(out_dir / log_name, "w") as log:
        log.write("$ " + " ".join(map(str, cmd)) + "\n")
        log.flush()
        try:
            rc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\nerror: timed out after {timeout} s\n")
            rc = 124
    return rc, time.time() - t0


def kernel_test_files():
    """The test files that name Triton (``make test-kernels``' list) and the ``cuda`` file."""
    files = [f for f in sorted(TESTS.glob("test_*.py")) if "triton" in f.read_text() and f != CUDA_TESTS]
    return files + [CUDA_TESTS]


_VERBOSE_LINE = re.compile(r"(?:(PASSED|FAILED|ERROR|SKIPPED) \S+?::(\S+)$|\S+?::(\S+) (PASSED|FAILED|ERROR|SKIPPED)\b)")


def _from_verbose_log(path: Path):
    """{test id: result} from the ``pytest -v`` lines of a log (with or without xdist): a run stopped by its time
    limit writes no junit file, yet every test it finished is named in the log."""
    out = {}
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        m = _VERBOSE_LINE.search(line.strip())
        if m:
            status, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
            out[name] = {"PASSED": "passed", "SKIPPED": "skipped"}.get(status, "failed")
    return out


def _junit(path: Path, log: Optional[Path] = None):
    """{test id: 'passed' | 'failed' | 'skipped'} from a pytest junit file, else from its verbose ``log``."""
    if not path.is_file():
        return _from_verbose_log(log) if log is not None else {}
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kids = {c.tag for c in case}
        out[case.get("name")] = ("failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids
                                 else "passed")
    return out


def _test_env(dry_run: bool):
    env = {"HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1" if dry_run else "0", "TTT_ZOO_EAGER_FAILURES": "1"}
    if dry_run:
        env["TTT_ZOO_CUDA_TESTS_DEVICE"] = "cpu"
    return env


def step_tests(args, out: Path, files, log):
    """Each file in its own pytest process (``--parallel`` files at once, ``--xdist`` workers each); {file name:
    (rc, junit results, command shown in the records, ids collected)}.  The collected ids are written by
    ``tools/pytest_collected.py`` before the first test runs: a file cut off by its time limit still names the cases
    it did not reach."""
    from concurrent.futures import ThreadPoolExecutor
    env = _test_env(args.dry_run)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tools"), os.environ.get("PYTHONPATH")]))
    if args.first:
        env["PYTEST_FIRST_N"] = str(args.first)
    prefix = " ".join(f"{k}={v}" for k, v in env.items() if k in ("TRITON_INTERPRET", "PYTEST_FIRST_N"))

    def one(f):
        xml, collected = out / f"{f.stem}.xml", out / f"{f.stem}.collected"
        sel = []
        if f == CUDA_TESTS and args.subset:  # test ids start with the op
            sel = ["-k", " or ".join(args.only_ops)]
        elif args.dry_run:  # the interpreter is slow: one quick case of the op's own file
            sel = DRY_RUN_FIRST if args.first else ["-k", DRY_RUN_TESTS]
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "pytest_collected",
               f.relative_to(ROOT), *sel]
        # a hung or minutes-long case costs itself, not the file: each test's own limit, and every test named
        # with its duration in the log (what the 2026-11-26 lease lacked)
        limits = ["--durations=0", f"--timeout={args.test_timeout}", "-o", "timeout_method=signal"]
        n = args.xdist if f == CUDA_TESTS else args.xdist_op
        workers = ["-n", str(n)] if n > 1 else []
        rc, secs = _run(cmd + limits + workers + [f"--junitxml={xml}"], out, f"{f.stem}.log",
                        {**env, "PYTEST_COLLECTED_FILE": str(collected)}, args.timeout())
        log(f"tests {f.name}: rc {rc}, {secs:.0f} s")
        shown = " ".join([prefix, "python"] + [repr(c) if " " in str(c) else str(c) for c in cmd[1:]])
        ids = collected.read_text().split() if collected.is_file() else []
        return f.name, (rc, _junit(xml, out / f"{f.stem}.log"), shown, ids)

    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        return dict(pool.map(one, files))


def passed_ops(results, dry_run: bool):
    """{op: commands that passed}: its folder's test file(s) ran to the end with no failure and some passes, and
    every collected ``cuda`` case of the op ran and passed (skips allowed only in the dry run, where the folder file
    runs a subset).  A case collected but not reached (the file cut off by its time limit) means no record."""
    from ttt_zoo.kernels import available_ops
    from ttt_zoo.kernels.backend import TRITON_BACKEND, kernel_folder
    _, cuda_cases, cuda_cmd, cuda_ids = results.get(CUDA_TESTS.name, (1, {}, "", []))
    ok = {}
    for op, impls in available_ops().items():
        folder = kernel_folder(op)
        if not impls[TRITON_BACKEND] or folder is None:
            continue
        files = [name for name in results if name.startswith(f"test_op_{folder}")]
        cases = {k: cuda_cases.get(k, "not run") for k in cuda_ids if f"[{op}-" in k}
        folder_ok = files and all(results[n][0] == 0 and "passed" in results[n][1].values() for n in files)
        cuda_ok = cases and all(v == "passed" or (dry_run and v == "skipped") for v in cases.values())
        if folder_ok and cuda_ok:
            ok[op] = "; ".join([results[n][2] for n in files] + [cuda_cmd])
    return ok


def write_records(ops, path: Path, dry_run: bool):
    """Add a record per op (replacing that op's records from the same GPU); the list written."""
    import torch
    from ttt_zoo.kernels.backend import KERNELS_DIR, kernel_source_hash, kernel_sources
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = "cpu (Triton interpreter, dry run)" if dry_run else torch.cuda.get_device_name()
    old = json.loads(path.read_text()) if path.is_file() else []
    if not isinstance(old, list):
        raise ValueError(f"{path} is not a JSON list of records")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = [dict(op=op, sha256=kernel_source_hash(op),
                files=[f.relative_to(KERNELS_DIR).as_posix() for f in kernel_sources(op)], gpu=gpu,
                torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda, date=date, command=cmd)
           for op, cmd in sorted(ops.items())]
    records = [r for r in old if not (r.get("op") in ops and r.get("gpu") == gpu)] + new
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")
    return new


def _bench_cmds(args, out: Path):
    """(step name, command, extra env) of the benchmark and profile runs."""
    bench = [sys.executable, "-c", "import sys; from ttt_zoo.cli import main; sys.exit(main())", "bench"]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tools"), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1" if args.dry_run else "0"}
    if args.dry_run:  # a wrapped DiT3 and the DeiT-T peer, ViT3-T's profile: one tiny size, training only
        how = ["--device", "cpu", "--threads", "1", "-b", "1", "--num-warm-iter", "0", "--num-bench-iter", "1"]
        return [("bench", bench + ["--import", "gpu_check", "--model", WRAPPED + DIFFUSION[0], "--peers",
                                   "deit_tiny_patch16_224", "--bench", "train", "--img-size", "16"] + how
                 + ["--output", out / "bench"], env),
                ("profile", bench + ["--profile", "--model", "vit3_tiny", "--bench", "train", "--img-size", "32"]
                 + how + ["--output", out / "profile"], env)]
    how = ["--device", "cuda", "--amp", "--amp-dtype", "bfloat16", "--num-warm-iter", "3", "--num-bench-iter", "10"]
    sizes = args.sizes or SIZES
    cmds = [("bench_classification", bench + ["--model", *args.models, "--peers", "deit_tiny_patch16_224", "--bench",
                                              "both", "--img-size", *map(str, sizes), "--batch-tokens", "12544"]
             + how + ["--output", out / "bench_classification"], env)]
    for latent in [LATENTS[SIZES.index(s)] for s in sizes]:  # --batch-tokens counts patch-16 tokens: the same
        # 12544 tokens at patch 2, size by size
        batch = max(1, 12544 // (latent // 2) ** 2)
        cmds.append((f"bench_diffusion_{latent}", bench + [
            "--import", "gpu_check", "--model", *[WRAPPED + m for m in DIFFUSION], "--peers", WRAPPED + DIT_PEER,
            "--bench", "both", "--img-size", str(latent), "-b", str(batch)] + how
            + ["--output", out / f"bench_diffusion_{latent}"], env))
    return cmds + [("profile", bench + ["--profile", "--model", "vit3_tiny", "--peers", "deit_tiny_patch16_224",
                                        "--bench", "train", "--img-size", "224", "2048", "--batch-tokens", "12544"]
                    + how + ["--output", out / "profile"], env)]


# ------------------------------------------------------------------------- the plan of tools/gpu_lease.sh
GRAPH_SIZES = [224, 1024]  # its CUDA-graph step: ViT3-T and DeiT-T compiled with reduce-overhead at these sizes
PLAN_ORDER = ["kernels_json", "verify", "bench_families", "graphs", "profile"]  # the most valuable first


def model_families():
    """{family: its models}: each ``ttt_zoo.models`` module that registers timm models, less the DiT baseline."""
    import pkgutil
    import timm
    import ttt_zoo.models
    ours = {m.name for m in pkgutil.iter_modules(ttt_zoo.models.__path__)} & set(timm.list_modules())
    return {f: timm.list_models(module=f) for f in sorted(ours - {DIT_PEER.split("_")[0]})}


def plan_problems(text: str):
    """What is wrong with the plan ``GPU_LEASE_PLAN=1 bash tools/gpu_lease.sh`` printed (its header ``# plan
    budget=B reserve=R setup=S second_call=C``, then a row per unit: name, step, cap s, min s, call, command);
    [] when every command parses with its tool's parser, every op with a Triton kernel is verified, every family
    is benchmarked, the CUDA-graph step covers GRAPH_SIZES, the steps come in PLAN_ORDER and each call's units fit
    its budget."""
    import contextlib
    import io
    import shlex
    from ttt_zoo.cli import build_parser as cli_parser
    from ttt_zoo.kernels import available_ops
    lines = text.splitlines()
    head = dict(kv.split("=") for kv in lines[0].split()[2:]) if lines and lines[0].startswith("# plan ") else {}
    if set(head) != {"budget", "reserve", "setup", "second_call"}:
        return ["the plan has no header '# plan budget=B reserve=R setup=S second_call=C'"]
    budget, reserve, setup, second = (int(head[k]) for k in ("budget", "reserve", "setup", "second_call"))
    problems, verified, benched, graph_sizes, steps, used = [], set(), set(), set(), [], {1: setup, 2: setup // 3}
    for row in (line.split("\t") for line in lines[1:] if line.strip()):
        if len(row) != 6:
            problems.append(f"plan row {row!r}: not six tab-separated fields")
            continue
        name, step, cap, minimum, call, cmd = row
        if step not in PLAN_ORDER:
            problems.append(f"{name}: unknown step {step}")
            continue
        steps.append(step)
        if not 0 < int(minimum) <= int(cap):
            problems.append(f"{name}: minimum {minimum} s not within its cap {cap} s")
        if call not in ("1", "2"):
            problems.append(f"{name}: call {call}, not 1 or 2")
            continue
        used[int(call)] += int(cap)
        argv = shlex.split(cmd)
        gc = "tools/gpu_check.py" in argv[1:2]
        parser = build_parser() if gc else cli_parser()
        err = io.StringIO()
        try:  # a ttt-zoo command: the arguments after `-m ttt_zoo` (also where a wrapper runs it)
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv[2:] if gc else argv[argv.index("ttt_zoo") + 1:])
        except ValueError:
            problems.append(f"{name}: neither tools/gpu_check.py nor python -m ttt_zoo")
            continue
        except SystemExit:
            problems.append(f"{name}: its command does not parse: {err.getvalue().strip().splitlines()[-1:]}")
            continue
        if gc:
            verified |= set(args.only_ops or []) if "tests" in args.steps else set()
            benched |= set(args.models) | set(DIFFUSION) if "bench" in args.steps else set()
        elif args.command == "bench":
            benched |= set(args.model)
            if step == "graphs" and args.runtime == ["compile"] and args.torchcompile_mode == "reduce-overhead":
                graph_sizes |= {h for h, w in args.img_size if h == w}
    kernel_ops = {op for op, impls in available_ops().items() if impls["triton"]}
    if kernel_ops - verified:
        problems.append(f"no verification unit for {', '.join(sorted(kernel_ops - verified))}")
    for family, models in model_families().items():
        if not benched & set(models):
            problems.append(f"no benchmark of the {family} family (one of {', '.join(models[:3])}, ...)")
    if set(GRAPH_SIZES) - graph_sizes:
        problems.append(f"the CUDA-graph step lacks {sorted(set(GRAPH_SIZES) - graph_sizes)} px")
    ranks = [PLAN_ORDER.index(s) for s in steps]
    if ranks != sorted(ranks):
        problems.append(f"steps out of order: {' '.join(dict.fromkeys(steps))}; want {' '.join(PLAN_ORDER)}")
    if used[1] > budget - reserve:
        problems.append(f"call 1 needs {used[1]} s (setup included), more than its {budget} s less {reserve}")
    if used[2] > second - reserve:
        problems.append(f"call 2 needs {used[2]} s, more than its {second} s less {reserve}")
    return problems


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--output", default="gpu_check_out", help="folder for every step's results")
    p.add_argument("--dry-run", action="store_true", help="the CPU and the interpreter, tiny, records in --output")
    p.add_argument("--records", help="records file to update (default: the repository's kernels/gpu_verified.json; "
                                     "dry run: OUTPUT/gpu_verified.json)")
    p.add_argument("--steps", nargs="+", default=["tests", "bench", "profile", "records"],
                   choices=["tests", "bench", "profile", "records"])
    p.add_argument("--models", nargs="+", default=CLASSIFIERS, help="classifiers benchmarked against DeiT-T")
    p.add_argument("--sizes", nargs="+", type=int, choices=SIZES, default=None,
                   help="image sizes of the benchmark (default: all; the DiT latents follow them)")
    p.add_argument("--only-ops", nargs="+", default=None, help="ops whose tests run (dry run: key_instance_norm)")
    p.add_argument("--step-timeout", type=int, default=1800, help="seconds per subprocess")
    p.add_argument("--deadline", type=int, default=None,
                   help="seconds for the whole run: each step gets at most what is left (a short GPU lease)")
    p.add_argument("--parallel", type=int, default=1, help="test files run at once (one GPU is shared)")
    p.add_argument("--xdist", type=int, default=1, help="pytest-xdist workers for the cuda file (the others: one process each)")
    p.add_argument("--xdist-op", type=int, default=1, help="pytest-xdist workers for each other file")
    p.add_argument("--test-timeout", type=int, default=120, help="seconds for one test (pytest-timeout)")
    p.add_argument("--first", type=int, default=None, metavar="N",
                   help="run only the first N selected tests of each file (the lease script's CPU dry run; an "
                        "op file's from its interpreter cases, DRY_RUN_FIRST)")
    p.add_argument("--check-plan", metavar="FILE",
                   help="check the plan tools/gpu_lease.sh printed (GPU_LEASE_PLAN=1) and run nothing: one line per "
                        "problem, exit 1 if any")
    p.add_argument("--test-files", nargs="+", default=None,
                   help="test file names to run (default: every file that names Triton, and the cuda file)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    start = time.time()

    def timeout():
        if args.deadline is None:
            return args.step_timeout
        return max(1, min(args.step_timeout, int(args.deadline - (time.time() - start))))
    args.timeout = timeout
    if args.check_plan:
        problems = plan_problems(Path(args.check_plan).read_text())
        for line in problems:
            print(f"plan: {line}")
        return 1 if problems else 0
    from ttt_zoo.kernels.backend import KERNELS_DIR, TRITON_BACKEND, kernel_folder
    from ttt_zoo.kernels import available_ops
    kernel_ops = sorted(op for op, i in available_ops().items() if i[TRITON_BACKEND])
    args.subset = args.only_ops is not None or args.dry_run
    args.only_ops = args.only_ops or (["key_instance_norm"] if args.dry_run else kernel_ops)
    unknown = sorted(set(args.only_ops) - set(kernel_ops))
    if unknown:
        p.error(f"--only-ops: no kernel op {', '.join(unknown)}; choose from {', '.join(kernel_ops)}")
    out = Path(args.output).resolve()
    repo_records = (KERNELS_DIR / "gpu_verified.json").resolve()
    records = Path(args.records).resolve() if args.records else out / "gpu_verified.json" if args.dry_run \
        else repo_records
    if args.dry_run and records == repo_records:
        p.error("--dry-run never writes the repository's records; give another --records file")
    if not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            p.error("no CUDA device here; run with --dry-run on the CPU")
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# gpu_check {'(dry run) ' if args.dry_run else ''}{datetime.date.today()}", "",
             "| step | status | seconds | results |", "|---|---|---:|---|"]

    def log(msg):
        print(msg, flush=True)

    failed = False
    results = {}
    if "tests" in args.steps:
        folders = {kernel_folder(op) for op in args.only_ops}
        own = [f for f in kernel_test_files() if any(f.stem.startswith(f"test_op_{d}") for d in folders)]
        files = own + [CUDA_TESTS] if args.subset else kernel_test_files()
        if args.test_files:
            unknown = sorted(set(args.test_files) - {f.name for f in kernel_test_files()})
            if unknown:
                p.error(f"--test-files: not a kernel test file: {', '.join(unknown)}")
            files = [f for f in files if f.name in args.test_files]
        t0 = time.time()
        results = step_tests(args, out / "tests", files, log)
        bad = [n for n, (rc, *_) in results.items() if rc != 0]
        failed |= bool(bad)
        lines.append(f"| tests | {'failed: ' + ', '.join(bad) if bad else 'passed'} | {time.time() - t0:.0f} | "
                     f"tests/ |")
    for name, cmd, env in _bench_cmds(args, out):
        if ("profile" if name == "profile" else "bench") not in args.steps:
            continue
        rc, secs = _run(cmd, out / name, "log.txt", env, args.timeout())
        log(f"{name}: rc {rc}, {secs:.0f} s")
        failed |= rc != 0
        lines.append(f"| {name} | {'passed' if rc == 0 else f'failed (rc {rc})'} | {secs:.0f} | {name}/ |")
    if "records" in args.steps:
        ops = passed_ops(results, args.dry_run)
        ops = {op: c for op, c in ops.items() if op in args.only_ops}
        new = write_records(ops, records, args.dry_run)
        (out / "records.json").write_text(json.dumps(new, indent=1) + "\n")
        lines.append(f"| records | {len(new)} written to {records} | | records.json |")
        log(f"records: {', '.join(r['op'] for r in new) or 'none'} -> {records}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {out / 'summary.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
