"""CPU: T5-tiny training step (forward + backward), batch 1: the inner step and key-norm on the plain reference
under autograd (``torch_naive``) vs. the recomputing autograd.Functions (``torch``), each without and with the
mixer-level recomputation (``T5TTT.recompute``: store the mixer input, recompute qkv / norm / convs / inner step in
the backward), DeiT-T alongside.

Every configuration runs in a fresh subprocess (the child of ``ttt_zoo.benchmark``: peak-RSS growth over the
loaded model during the first step, median latency); all configurations in one invocation, so ratios are side by
side.

    python tools/bench_t5_backends.py [--sizes 224 512] [--iters 2] [--out tools/results/t5_backends_cpu.md]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

from ttt_zoo.benchmark import _CHILD

# the benchmark child, plus: T5 mixers' `recompute` from the environment
_SET = ("model.train(train)\nfor _m in model.modules():\n    if hasattr(_m, 'recompute'):\n"
        "        _m.recompute = os.environ.get('T5_RECOMPUTE', '1') == '1'\n")
CHILD = _CHILD.replace("model.train(train)\n", _SET)
assert CHILD != _CHILD


def measure(model: str, size: int, iters: int, backend: str, recompute: bool) -> dict:
    env = dict(os.environ, T5_RECOMPUTE="1" if recompute else "0")
    if backend != "-":
        env["TTT_ZOO_BACKEND"] = backend
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(size), str(iters), "1"], capture_output=True,
                         text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{model} {size}px {backend} failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r.update(backend=backend, recompute=recompute if backend != "-" else "-")
    return r


def saved_activation_mb(model_name: str, size: int, backend: str, recompute: bool) -> float:
    """MB of distinct non-parameter storages autograd keeps after one training forward (deterministic)."""
    import timm
    import ttt_zoo  # noqa: F401
    old = os.environ.get("TTT_ZOO_BACKEND")
    if backend != "-":
        os.environ["TTT_ZOO_BACKEND"] = backend
    try:
        kw = dict(dynamic_img_size=True) if model_name.startswith("deit") else {}
        model = timm.create_model(model_name, **kw).train()
        for m in model.modules():
            if hasattr(m, "recompute"):
                m.recompute = recompute
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(1, 3, size, size))
        return sum(seen.values()) / 2 ** 20
    finally:
        if old is None:
            os.environ.pop("TTT_ZOO_BACKEND", None)
        else:
            os.environ["TTT_ZOO_BACKEND"] = old


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[224, 512])
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--model", default="t5_tiny")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "t5_backends_cpu.md"))
    args = ap.parse_args()
    configs = [(args.model, "torch_naive", False), (args.model, "torch", False), (args.model, "torch", True),
               ("deit_tiny_patch16_224", "-", False)]
    rows = []
    for size in args.sizes:
        for model, backend, recompute in configs:
            rows.append(measure(model, size, args.iters, backend, recompute))
            print(rows[-1], flush=True)
    lines = [f"# {args.model} training step on CPU: inner-step backends", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, forward + backward, "
             f"median of {args.iters} steps after a first step; peak = RSS growth over the loaded model during the "
             "first step.  Shared machine (other jobs running): latencies are noisy, memory is reliable.", "",
             "| size | model | inner backend | mixer recompute | step ms | peak MB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['model']} | {r['backend']} | {r['recompute']} | {r['latency_ms']:.0f} | "
                     f"{r['peak_mb']:.0f} |")
    lines += ["", "Activations saved for the backward after the forward (MB of distinct non-parameter storages, "
              "from autograd's saved-tensor hooks; deterministic, unlike RSS):", "",
              "| size | model | inner backend | mixer recompute | saved MB |", "|---|---|---|---|---|"]
    for size in args.sizes:
        for model, backend, recompute in configs:
            mb = saved_activation_mb(model, size, backend, recompute)
            lines.append(f"| {size} | {model} | {backend} | {recompute if backend != '-' else '-'} | {mb:.1f} |")
    lines += ["", "Ratios to torch_naive without mixer recompute (same size):", ""]
    for size in args.sizes:
        rs = [r for r in rows if r["size"] == size]
        base = rs[0]
        for r in rs[1:]:
            lines.append(f"- {size}px {r['model']} {r['backend']} recompute={r['recompute']}: "
                         f"time {r['latency_ms'] / base['latency_ms']:.2f}x, "
                         f"peak memory {r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
