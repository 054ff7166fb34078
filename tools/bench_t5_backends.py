"""CPU: T5-tiny training step (forward + backward), batch 1, with the inner step and key-norm on the plain
reference under autograd (``torch_naive``) vs. the recomputing autograd.Function (``torch``), DeiT-T alongside.

Every (model, backend, size) runs in a fresh subprocess (``ttt_zoo.benchmark.measure``: peak-RSS growth over the
loaded model, median latency); all configurations in one invocation, so the ratios are side by side.

    python tools/bench_t5_backends.py [--sizes 224 512] [--iters 2] [--out tools/results/t5_backends_cpu.md]
"""
import argparse
import os
import platform
import time

import torch

from ttt_zoo.benchmark import measure


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[224, 512])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--model", default="t5_tiny")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "t5_backends_cpu.md"))
    args = ap.parse_args()
    configs = [(args.model, "torch_naive"), (args.model, "torch"), ("deit_tiny_patch16_224", "-")]
    rows = []
    for size in args.sizes:
        for model, backend in configs:
            old = os.environ.get("TTT_ZOO_BACKEND")
            if backend != "-":
                os.environ["TTT_ZOO_BACKEND"] = backend  # inherited by the child process
            try:
                r = measure(model, size, iters=args.iters, train=True)
            finally:
                if old is None:
                    os.environ.pop("TTT_ZOO_BACKEND", None)
                else:
                    os.environ["TTT_ZOO_BACKEND"] = old
            r["backend"] = backend
            rows.append(r)
            print(r, flush=True)
    lines = [f"# {args.model} training step on CPU: inner-step backends", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, forward + backward, "
             f"median of {args.iters} steps after a first step; peak = RSS growth over the loaded model during the "
             "first step.  Shared machine (other jobs running): latencies are noisy, memory is reliable.", "",
             "| size | model | backend | step ms | peak MB |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['model']} | {r['backend']} | {r['latency_ms']:.0f} | {r['peak_mb']:.0f} |")
    lines += ["", "Ratios torch / torch_naive (same size):", ""]
    for size in args.sizes:
        by = {r["backend"]: r for r in rows if r["size"] == size and r["model"] == args.model}
        lines.append(f"- {size}px: time {by['torch']['latency_ms'] / by['torch_naive']['latency_ms']:.2f}x, "
                     f"peak memory {by['torch']['peak_mb'] / max(by['torch_naive']['peak_mb'], 1e-9):.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
