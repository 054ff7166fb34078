"""CPU latency and memory of the TTT models (reference path vs. the recomputing path) next to timm's DeiT-T.

Every (model, resolution, mode) runs in a FRESH subprocess, so one configuration's allocator state cannot leak into
another's numbers.  Memory is the growth of the process's peak resident set during the measured call:
VmHWM (reset to the current RSS through ``/proc/self/clear_refs`` just before the call) minus the RSS before it, with
the model and the input already built.  That is what a user sees ("training grows my process by X"), covers every allocator
(PyTorch's CPU allocator is plain malloc), and needs no tracing hooks that would slow the run.  Latency is the
median of ``--reps`` further calls.  All configurations run side by side in one invocation; the table goes to
``tools/results/cpu_bench.md``.

    python tools/bench_cpu.py                      # 224, 512, 1024; fwd and fwd+bwd; batch 1
    python tools/bench_cpu.py --res 224 --reps 2   # quicker
    python tools/bench_cpu.py --families vit3 hvit3 t5 visionttt --res 224 512
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from ttt_zoo.benchmark import TINY_MODELS as FAMILIES  # --families key -> (label, model)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = [  # label suffix, TTT_ZOO_BACKEND
    ("before: reference, plain autograd", "torch_naive"),
    ("after: recomputing torch path", "torch"),
]
DEIT = ("DeiT-T (timm, SDPA)", "deit_tiny_patch16_224", None)


def configs(families):
    out = [(f"{FAMILIES[f][0]} {suffix}", FAMILIES[f][1], backend) for f in families for suffix, backend in PATHS]
    return out + [DEIT]


def worker(model_name: str, res: int, mode: str, reps: int, threads: int) -> dict:
    import torch
    import timm
    import ttt_zoo  # noqa: F401  (registers the models)

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kw = dict(dynamic_img_size=True) if model_name.startswith("deit") else {}
    model = timm.create_model(model_name, num_classes=1000, **kw)
    x = torch.randn(1, 3, res, res)
    model.train(mode == "fwd+bwd")

    def step():
        if mode == "fwd":
            with torch.no_grad():
                model(x)
        else:
            model(x).float().sum().backward()
            model.zero_grad(set_to_none=True)

    from ttt_zoo.benchmark import peak_kb, reset_peak, rss_kb
    base = rss_kb()
    reset_peak()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    peak = peak_kb()
    times, cpu_times = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return dict(mem_mb=(peak - base) / 1024, ms=1e3 * statistics.median(times) if times else 1e3 * first,
                cpu_ms=1e3 * statistics.median(cpu_times) if cpu_times else float("nan"),
                params_m=sum(p.numel() for p in model.parameters()) / 1e6)


def run_one(model_name: str, backend, res: int, mode: str, reps: int, threads: int) -> dict:
    env = dict(os.environ)
    env.pop("TTT_ZOO_BACKEND", None)
    if backend:
        env["TTT_ZOO_BACKEND"] = backend
    cmd = [sys.executable, __file__, "--worker", model_name, str(res), mode, str(reps), str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{model_name} {backend} {res} {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--res", type=int, nargs="+", default=[224, 512, 1024])
    ap.add_argument("--reps", type=int, default=2, help="timed calls after the measured first call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--families", nargs="+", default=["vit3"], choices=sorted(FAMILIES))
    ap.add_argument("--out", default=os.path.join(ROOT, "tools", "results", "cpu_bench.md"))
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        name, res, mode, reps, threads = a.worker
        print(json.dumps(worker(name, int(res), mode, int(reps), int(threads))))
        return

    load_before = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = []
    for res in a.res:
        for label, name, backend in configs(a.families):
            r = {m: run_one(name, backend, res, m, a.reps, a.threads) for m in ("fwd", "fwd+bwd")}
            rows.append((res, label, r))
            print(f"{res:5d}  {label:36s} fwd {r['fwd']['ms']:8.1f} ms {r['fwd']['mem_mb']:7.1f} MB | "
                  f"fwd+bwd {r['fwd+bwd']['ms']:8.1f} ms {r['fwd+bwd']['mem_mb']:7.1f} MB", flush=True)

    import torch
    lines = [
        "# CPU benchmark: TTT models (reference autograd vs. recomputing torch path) next to DeiT-T",
        "",
        f"`python tools/bench_cpu.py --res {' '.join(map(str, a.res))} --reps {a.reps} --threads {a.threads} "
        f"--families {' '.join(a.families)}`; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {a.threads} threads, batch 1, float32; load average before the run "
        f"{load_before}. Every cell is a fresh subprocess, all side by side in this one run. Memory = growth of the "
        "peak RSS (VmHWM, reset just before the call) during the first call, model and input already built; "
        f"time = median wall time of {a.reps} later calls, img/s = 1000 / ms (batch 1).",
        "",
        "| res | model / path | params (M) | fwd ms | fwd img/s | fwd MB | fwd+bwd ms | fwd+bwd img/s | fwd+bwd MB "
        "| fwd+bwd MB / DeiT-T | fwd+bwd time / DeiT-T |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in a.res:
        deit = [r for rr, l, r in rows if rr == res and l.startswith("DeiT")][0]
        for rr, label, r in rows:
            if rr != res:
                continue
            f, fb = r["fwd"], r["fwd+bwd"]
            lines.append(f"| {res} | {label} | {f['params_m']:.2f} | {f['ms']:.0f} | {1e3 / f['ms']:.2f} | "
                         f"{f['mem_mb']:.0f} | {fb['ms']:.0f} | {1e3 / fb['ms']:.2f} | {fb['mem_mb']:.0f} | "
                         f"{fb['mem_mb'] / max(deit['fwd+bwd']['mem_mb'], 1e-9):.2f} | "
                         f"{fb['ms'] / deit['fwd+bwd']['ms']:.2f} |")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
