"""Op-level timing and peak memory of the T5 / DiT5 inner steps and the key instance-norm: Triton kernels vs. the
recomputing PyTorch path (``torch``) vs. the plain reference under autograd (``torch_naive``); forward alone and
forward + backward, at 196, 1024, 4096 and 16384 tokens (14^2 ... 128^2, the token count of a 224 ... 2048 px
image at patch 16), plus a max-|diff| check of each path against the fp32 reference.

    python tools/bench_gpu_t5.py [--dtype bf16] [--out tools/results/gpu_t5_ops.md]   # on a CUDA machine
    python tools/bench_gpu_t5.py --dry-run   # CPU, tiny shapes, PyTorch paths only: checks the script runs
"""
import argparse
import os
import time

import torch

from ttt_zoo.kernels.inner_mlp.naive import mlp_ttt_reference
from ttt_zoo.kernels.inner_mlp.torch import mlp_ttt_torch, t5_swiglu_ttt_torch
from ttt_zoo.kernels.key_norm import key_norm_reference, key_norm_torch
from ttt_zoo.kernels.inner_mlp.naive import t5_swiglu_ttt_reference

# (op, heads, d): T5-T (192 = 3 x 64), DiT5-S (384 = 6 x 64), one head dim 72 case (padded to 128 in the kernels)
OPS = [("t5", 3, 64), ("dit5", 6, 64), ("t5", 2, 72)]
TOKENS = {196: 64, 1024: 16, 4096: 4, 16384: 1}  # tokens: batch
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _paths(dry: bool):
    paths = {"t5": {"torch": t5_swiglu_ttt_torch, "torch_naive": t5_swiglu_ttt_reference},
             "dit5": {"torch": mlp_ttt_torch, "torch_naive": mlp_ttt_reference},
             "knorm": {"torch": key_norm_torch, "torch_naive": key_norm_reference}}
    if not dry:
        from ttt_zoo.kernels.inner_mlp.ops import mlp_ttt_op, t5_swiglu_ttt_op
        from ttt_zoo.kernels.key_norm.ops import key_norm_op
        paths["t5"]["triton"], paths["dit5"]["triton"] = t5_swiglu_ttt_op, mlp_ttt_op
        paths["knorm"]["triton"] = key_norm_op
    return paths


def _sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, iters):
    for _ in range(2):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(dev)
    return 1e3 * (time.perf_counter() - t0) / iters


def peak_mb(fn, dev):
    """Peak memory allocated during one call, above what was allocated before it (CUDA only)."""
    if dev != "cuda":
        return float("nan")
    _sync(dev)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    _sync(dev)
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def run(dev, dtype, tokens, ops, iters, dry):
    paths = _paths(dry)
    rows = []
    for op, heads, d in ops:
        for n, b in tokens.items():
            inputs = [torch.randn(b, heads, n, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)]
            n_w = 3 if op == "t5" else 2
            ws = [(torch.randn(1, heads, d, d, device=dev) * 0.02).requires_grad_() for _ in range(n_w)]
            args = inputs + ws + [d ** -0.5]
            ref = paths[op]["torch_naive"](*[t.detach().float() for t in inputs + ws], d ** -0.5)
            do = torch.randn_like(inputs[0])
            for name, f in paths[op].items():
                try:
                    with torch.no_grad():
                        diff = (f(*args).float() - ref).abs().max().item()
                    fwd = lambda: f(*args)  # noqa: E731
                    with torch.no_grad():
                        t_f, m_f = timeit(fwd, dev, iters), peak_mb(fwd, dev)
                    step = lambda: torch.autograd.backward(f(*args), do)  # noqa: E731
                    t_fb, m_fb = timeit(step, dev, iters), peak_mb(step, dev)
                    rows.append((op, heads, d, b, n, name, t_f, m_f, t_fb, m_fb, diff, ""))
                except Exception as e:  # report, do not hide (e.g. out of memory for the naive path)
                    rows.append((op, heads, d, b, n, name, *[float("nan")] * 5, f"{type(e).__name__}: {str(e)[:80]}"))
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                print(rows[-1], flush=True)
    # key instance-norm over (B, N, C): C = 192 (T5-T)
    for n, b in tokens.items():
        x = torch.randn(b, n, 192, device=dev, dtype=dtype, requires_grad=True)
        ref = key_norm_reference(x.detach().float(), 1.0)
        do = torch.randn_like(x)
        for name, f in paths["knorm"].items():
            with torch.no_grad():
                diff = (f(x, 1.0).float() - ref).abs().max().item()
            fwd = lambda: f(x, 1.0)  # noqa: E731
            with torch.no_grad():
                t_f, m_f = timeit(fwd, dev, iters), peak_mb(fwd, dev)
            step = lambda: torch.autograd.backward(f(x, 1.0), do)  # noqa: E731
            rows.append(("knorm", 1, 192, b, n, name, t_f, m_f, timeit(step, dev, iters), peak_mb(step, dev), diff, ""))
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, PyTorch paths only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.dry_run:
        dev, tokens, ops, iters = "cpu", {49: 2, 100: 1}, [("t5", 2, 16), ("dit5", 2, 16)], 2
        dtype = torch.float32
        out = args.out or "/tmp/gpu_t5_ops_dryrun.md"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_gpu_t5.py needs a CUDA GPU (use --dry-run to check the script on CPU)")
        dev, tokens, ops, iters, dtype = "cuda", TOKENS, OPS, args.iters, DTYPES[args.dtype]
        out = args.out or os.path.join(os.path.dirname(__file__), "results", "gpu_t5_ops.md")
    rows = run(dev, dtype, tokens, ops, iters, args.dry_run)
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (dry run)"
    lines = [f"# T5 / DiT5 inner step and key-norm ops: {name}, {str(dtype).split('.')[-1]}", "",
             "Peak = max memory allocated during one call above what was allocated before (inputs excluded). "
             "diff = max |out - fp32 reference|.", "",
             "| op | heads | d | B | N | path | fwd ms | fwd MB | fwd+bwd ms | fwd+bwd MB | diff | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in r) + " |")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
