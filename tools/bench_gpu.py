"""GPU benchmark: TTT models with the Triton kernels vs. the PyTorch paths vs. timm DeiT-T (SDPA), across resolutions.

Throughput (images/s) and peak memory (``torch.cuda.max_memory_allocated`` above the model+input baseline), for
the forward (eval, no_grad) and forward+backward (train), under bf16 autocast by default.  The batch shrinks with
the resolution so every configuration sees about the same number of tokens.  All configurations run side by side
in one process (``torch.cuda.reset_peak_memory_stats`` between them); the table goes to
``tools/results/gpu_bench.md``.

    python tools/bench_gpu.py                         # 224, 512, 1024, 2048
    python tools/bench_gpu.py --res 224 1024 --amp fp32 --out /tmp/gpu.md
    python tools/bench_gpu.py --families vit3 hvit3 t5 visionttt     # every family (ViT3 only by default)
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from ttt_zoo.benchmark import TINY_MODELS as FAMILIES  # --families key -> (label, model)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = [("triton", "triton"), ("torch (recompute)", "torch"), ("torch_naive", "torch_naive")]


def configs(families):
    rows = [(f"{FAMILIES[f][0]} {label}", FAMILIES[f][1], b) for f in families for label, b in BACKENDS]
    return rows + [("DeiT-T (timm SDPA)", "deit_tiny_patch16_224", None)]


def build(name: str):
    import timm
    import ttt_zoo  # noqa: F401
    kw = dict(dynamic_img_size=True) if name.startswith("deit") else {}
    return timm.create_model(name, **kw)


def measure(model, x, train: bool, amp, warmup: int, iters: int) -> dict:
    model.train(train)
    ctx = torch.autocast("cuda", dtype=amp) if amp is not None else torch.autocast("cuda", enabled=False)

    def step():
        with ctx:
            if train:
                out = model(x)
            else:
                with torch.no_grad():
                    out = model(x)
        if train:
            out.float().sum().backward()
            model.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    return dict(ips=x.shape[0] / dt, ms=dt * 1e3, mem_mb=peak / 2 ** 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--res", type=int, nargs="+", default=[224, 512, 1024, 2048])
    ap.add_argument("--tokens", type=int, default=64 * 196, help="batch = max(1, tokens // (res/16)^2)")
    ap.add_argument("--amp", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--families", nargs="+", default=["vit3"], choices=sorted(FAMILIES))
    ap.add_argument("--out", default=os.path.join(ROOT, "tools", "results", "gpu_bench.md"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device (use tools/bench_cpu.py on the CPU).")
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[a.amp]
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    rows = []
    for res in a.res:
        batch = max(1, a.tokens // (res // 16) ** 2)
        x = torch.randn(batch, 3, res, res, device="cuda")
        for label, name, backend in configs(a.families):
            if backend:  # the dispatch reads the backend at every call
                os.environ["TTT_ZOO_BACKEND"] = backend
            else:
                os.environ.pop("TTT_ZOO_BACKEND", None)
            model = build(name).cuda()
            r = {}
            for mode, train in (("fwd", False), ("fwd+bwd", True)):
                try:
                    r[mode] = measure(model, x, train, amp, a.warmup, a.iters)
                except torch.cuda.OutOfMemoryError:
                    r[mode] = None
                    torch.cuda.empty_cache()
            rows.append((res, batch, label, r))
            fmt = lambda m: "OOM" if m is None else f"{m['ips']:9.1f} img/s {m['mem_mb']:8.0f} MB"  # noqa: E731
            print(f"{res:5d} b{batch:<3d} {label:26s} fwd {fmt(r['fwd'])} | fwd+bwd {fmt(r['fwd+bwd'])}", flush=True)
            del model
            torch.cuda.empty_cache()

    import timm
    lines = [
        "# GPU benchmark: TTT models (Triton / torch / torch_naive) vs. DeiT-T (timm SDPA)", "",
        f"`python tools/bench_gpu.py --res {' '.join(map(str, a.res))} --amp {a.amp} --families {' '.join(a.families)}`; {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, timm {timm.__version__}, autocast {a.amp}; batch = {a.tokens} tokens / "
        f"(res/16)^2; throughput over {a.iters} iterations after {a.warmup} warm-ups; memory = peak allocated above "
        "the model+input baseline.", "",
        "| res | batch | model / path | fwd img/s | fwd MB | fwd+bwd img/s | fwd+bwd MB | fwd+bwd img/s vs DeiT |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for res, batch, label, r in rows:
        deit = [rr for q, _, l, rr in rows if q == res and l.startswith("DeiT")][0]
        f, fb = r["fwd"], r["fwd+bwd"]
        rel = (f"{fb['ips'] / deit['fwd+bwd']['ips']:.2f}x" if fb and deit["fwd+bwd"] else "-")
        cell = lambda m, k, p: "OOM" if m is None else f"{m[k]:.{p}f}"  # noqa: E731
        lines.append(f"| {res} | {batch} | {label} | {cell(f, 'ips', 1)} | {cell(f, 'mem_mb', 0)} | "
                     f"{cell(fb, 'ips', 1)} | {cell(fb, 'mem_mb', 0)} | {rel} |")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
