"""Peak memory and latency of Vision-TTT vs timm's DeiT of the same width, side by side in one run.

    python tools/bench_visionttt.py [--sizes 512 1024] [--pairs tiny] [--iters 3] [--device cpu|cuda]

Each (model, size) runs in its own subprocess (batch 1, inference, float32) so peak memory is its own:
on CUDA ``torch.cuda.max_memory_allocated``; on CPU the rise of the process's peak RSS over its RSS before the
first forward.  Latency is the median of ``--iters`` timed forwards after one warm-up.
Writes ``tools/results/visionttt_bench.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

PAIRS = {"tiny": ("visionttt_tiny", "deit_tiny_patch16_224"),
         "small": ("visionttt_small", "deit_small_patch16_224"),
         "base": ("visionttt_base", "deit_base_patch16_224")}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _child(name: str, size: int, iters: int, device: str) -> dict:
    import torch
    import timm
    import ttt_zoo  # noqa: F401
    kwargs = dict(dynamic_img_size=True) if name.startswith("deit") else {}
    model = timm.create_model(name, **kwargs).to(device).eval()
    x = torch.randn(1, 3, size, size, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _rss_mib()
        sync()
        t0 = time.perf_counter()
        model(x)
        sync()
        first = time.perf_counter() - t0
        if device == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
        times = []
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            model(x)
            sync()
            times.append(time.perf_counter() - t0)
    return dict(model=name, size=size, tokens=(size // 16) ** 2, peak_mib=peak,
                latency_ms=1e3 * statistics.median(times) if times else 1e3 * first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--pairs", nargs="+", default=["tiny"], choices=sorted(PAIRS))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "visionttt_bench.md"))
    ap.add_argument("--child", nargs=4, metavar=("NAME", "SIZE", "ITERS", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, size, iters, device = args.child
        print(json.dumps(_child(name, int(size), int(iters), device)))
        return
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for pair in args.pairs:
        for size in args.sizes:
            res = []
            for name in PAIRS[pair]:
                out = subprocess.run([sys.executable, __file__, "--child", name, str(size), str(args.iters), device],
                                     capture_output=True, text=True)
                if out.returncode:
                    raise RuntimeError(f"{name} at {size}px failed:\n{out.stderr[-2000:]}")
                res.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(res[-1], flush=True)
            rows.append(res)
    dev = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()}, " \
                                                                     f"{torch.get_num_threads()} threads)"
    lines = [
        "# Vision-TTT vs DeiT: peak memory and latency",
        "",
        f"`python tools/bench_visionttt.py {' '.join(sys.argv[1:])}`; device: {dev}; torch {torch.__version__}; "
        f"batch 1, float32, inference (no grad), median of {args.iters} forwards after a warm-up.",
        "Vision-TTT runs the pure-PyTorch reference scan (Python loop over mini-batches, no fused kernel); "
        "DeiT runs timm's attention (`dynamic_img_size=True`), i.e. fused `F.scaled_dot_product_attention`, "
        "whose memory is linear in the tokens too; its time is quadratic.",
        "Peak memory: " + ("`torch.cuda.max_memory_allocated` above the allocation before the forward." if device == "cuda"
                           else "rise of the process's peak RSS over its RSS before the first forward (CPU)."),
        "",
        "| size | tokens | model | peak MiB | latency ms | DeiT / Vittt memory | DeiT / Vittt latency |",
        "|---|---|---|---|---|---|---|",
    ]
    for vit, deit in rows:
        for r in (vit, deit):
            ratio_m = f"{deit['peak_mib'] / max(vit['peak_mib'], 1e-9):.2f}x" if r is vit else ""
            ratio_t = f"{deit['latency_ms'] / vit['latency_ms']:.2f}x" if r is vit else ""
            lines.append(f"| {r['size']} | {r['tokens']} | {r['model']} | {r['peak_mib']:.1f} | {r['latency_ms']:.1f} "
                         f"| {ratio_m} | {ratio_t} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
