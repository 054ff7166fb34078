"""Side-by-side CPU measurements: latency and peak memory of models at several resolutions.

Every (model, size) runs in a fresh subprocess, so peak-RSS growth is measured without interference from
earlier runs; all configurations are measured in one invocation, so ratios are comparable.
"""

import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["measure", "scaling_table", "format_table", "rss_kb", "reset_peak", "peak_kb", "TINY_MODELS"]

# the tiny model of each TTT family, as the benchmark scripts name them: key -> (label, timm model name)
TINY_MODELS = {"vit3": ("ViT3-T", "vit3_tiny"), "hvit3": ("H-ViT3-T", "hvit3_tiny"), "t5": ("T5-T", "t5_tiny"),
               "visionttt": ("Vittt-T", "visionttt_tiny")}


def rss_kb() -> int:
    """Current resident set size of this process (KiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, the peak RSS, to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_kb() -> int:
    """Peak resident set size (VmHWM) since the last :func:`reset_peak` (KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


_CHILD = r"""
import json, statistics, sys, time
import torch
import timm
import ttt_zoo  # noqa: F401
from ttt_zoo.benchmark import peak_kb, reset_peak, rss_kb
name, size, iters, train = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
torch.manual_seed(0)
kw = dict(dynamic_img_size=True) if name.startswith(("deit", "vit_")) else {}
model = timm.create_model(name, num_classes=1000, **kw)
model.train(train)
x = torch.randn(1, 3, size, size)
def step():
    if train:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    else:
        with torch.no_grad():
            model(x)
base = rss_kb(); reset_peak()  # the first step's peak: pages the forward needs beyond the loaded model
t0 = time.perf_counter(); step(); first = time.perf_counter() - t0
peak = peak_kb()
times = []
for _ in range(iters):
    t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
print(json.dumps(dict(model=name, size=size, train=train, latency_ms=1e3 * statistics.median(times or [first]),
                      peak_mb=max(peak - base, 0) / 1024.0)))
"""


def measure(model: str, size: int, iters: int = 3, train: bool = False, threads: Optional[int] = None) -> Dict:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, "-c", _CHILD, model, str(size), str(iters), "1" if train else "0"],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark of {model} at {size}px failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def scaling_table(models: Sequence[str], sizes: Sequence[int], iters: int = 3, train: bool = False) -> List[Dict]:
    return [measure(m, s, iters, train) for s in sizes for m in models]


def format_table(rows: List[Dict]) -> str:
    models = list(dict.fromkeys(r["model"] for r in rows))
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    by = {(r["model"], r["size"]): r for r in rows}
    head = "| size | " + " | ".join(f"{m} ms | {m} MB" for m in models)
    if len(models) == 2:
        head += f" | latency {models[0]}/{models[1]} | memory {models[0]}/{models[1]}"
    lines = [head + " |", "|" + "---|" * (head.count("|"))]
    for s in sizes:
        cells = [f"{s}x{s}"]
        for m in models:
            r = by[(m, s)]
            cells += [f"{r['latency_ms']:.1f}", f"{r['peak_mb']:.1f}"]
        if len(models) == 2:
            a, b = by[(models[0], s)], by[(models[1], s)]
            cells += [f"{a['latency_ms'] / b['latency_ms']:.2f}x",
                      f"{a['peak_mb'] / max(b['peak_mb'], 1e-6):.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    t0 = time.time()
    rows = scaling_table(["vit3_tiny", "deit_tiny_patch16_224"], [224, 512, 1024])
    print(format_table(rows))
    print(f"({time.time() - t0:.0f}s)")
