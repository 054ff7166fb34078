"""Vision-TTT vs timm's DeiT of the same width: time and peak memory of inference and of a training step,
side by side in one run, optionally also for the code of an older commit ("before").

    python tools/bench_visionttt.py [--sizes 224 512] [--modes fwd fwdbwd] [--pairs tiny] [--repeats 3]
                                    [--batch 1] [--threads 1] [--before REV] [--device cpu|cuda]

Every (model, code version, size, mode) runs ``--repeats`` times, each in a fresh subprocess, and the table reports
the median over the repeats; the repeats are interleaved (one round of every config, then the next round), so
load from other processes hits all configs alike.  A subprocess does one untimed warm-up iteration and one timed
iteration.  ``fwd``: ``model.eval()`` under ``torch.inference_mode()``; ``fwdbwd``: ``model.train()``, forward,
``out.square().mean().backward()`` (gradients set to None before each iteration).
Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above the allocation before the first iteration; on CPU the
rise of the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) over its RSS before the first
iteration (so it includes gradients and any one-time allocations).  CPU time is the process time of the timed
iteration (on a shared machine it moves less than wall time).
``--before REV`` also runs the ``visionttt_*`` models with the code of git revision REV (exported to a temporary
directory and put first on ``sys.path``), DeiT once.
Writes ``tools/results/visionttt_bench.md`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

PAIRS = {"tiny": ("visionttt_tiny", "deit_tiny_patch16_224"),
         "small": ("visionttt_small", "deit_small_patch16_224"),
         "base": ("visionttt_base", "deit_base_patch16_224")}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _child(name: str, size: int, mode: str, batch: int, device: str, threads: int, src: str) -> dict:
    if src:
        sys.path.insert(0, src)
    import torch
    import timm
    import ttt_zoo
    if src and not os.path.abspath(ttt_zoo.__file__).startswith(os.path.abspath(src)):
        raise RuntimeError(f"ttt_zoo imported from {ttt_zoo.__file__}, not from {src}")
    if device == "cpu":
        torch.set_num_threads(threads)
    kwargs = dict(dynamic_img_size=True) if name.startswith("deit") else {}
    model = timm.create_model(name, **kwargs).to(device)
    model.train(mode == "fwdbwd")
    x = torch.randn(batch, 3, size, size, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        if mode == "fwd":
            with torch.inference_mode():
                model(x)
        else:
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
        sync()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _status_mib("VmRSS")
    step()  # warm-up
    c0, t0 = time.process_time(), time.perf_counter()
    step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20 if device == "cuda" else _status_mib("VmHWM") - base
    return dict(model=name, size=size, mode=mode, peak_mib=peak, wall_ms=1e3 * wall, cpu_ms=1e3 * cpu)


def _export(rev: str) -> str:
    """The tree of ``rev`` in a temporary directory, with ``ttt_zoo/kernels`` linked as the package maps it."""
    dst = tempfile.mkdtemp(prefix="vittt_bench_")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)
    os.symlink(os.path.join(dst, "kernels"), os.path.join(dst, "ttt_zoo", "kernels"))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[224, 512])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--pairs", nargs="+", default=["tiny"], choices=sorted(PAIRS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--before", default=None, help="git revision whose Vision-TTT code is measured as 'before'")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--out", default=os.path.join(ROOT, "tools", "results", "visionttt_bench.md"))
    ap.add_argument("--child", nargs=7, metavar=("NAME", "SIZE", "MODE", "BATCH", "DEVICE", "THREADS", "SRC"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, size, mode, batch, device, threads, src = args.child
        print(json.dumps(_child(name, int(size), mode, int(batch), device, int(threads), src if src != "-" else "")))
        return
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    before = _export(args.before) if args.before else None
    configs = []  # (label, model, src, size, mode)
    for pair in args.pairs:
        vit, deit = PAIRS[pair]
        for size in args.sizes:
            for mode in args.modes:
                if before:
                    configs.append((f"{vit} (before)", vit, before, size, mode))
                configs.append((vit, vit, "-", size, mode))
                configs.append((deit, deit, "-", size, mode))
    runs = {c: [] for c in configs}
    for rep in range(args.repeats):
        for c in configs:
            label, name, src, size, mode = c
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, str(size), mode, str(args.batch),
                   device, str(args.threads), src]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"{label} {mode} at {size}px failed:\n{out.stderr[-3000:]}")
            runs[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rep, label, runs[c][-1], flush=True)

    def med(c, key):
        return statistics.median(r[key] for r in runs[c])

    dev = torch.cuda.get_device_name() if device == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads})"
    cmdline = " ".join(["python tools/bench_visionttt.py"] + sys.argv[1:])
    lines = [
        "# Vision-TTT vs DeiT: time and peak memory, inference and training step",
        "",
        f"`{cmdline}`; device: {dev}; torch {torch.__version__}; batch {args.batch}, float32.",
        f"Every number is the median of {args.repeats} fresh subprocesses (repeats interleaved across configs); "
        "each subprocess times one iteration after one warm-up.",
        "`fwd`: eval, `torch.inference_mode`; `fwd+bwd`: train mode, forward + backward of `out.square().mean()`.",
        "Peak memory: " + ("`torch.cuda.max_memory_allocated` above the allocation before the first iteration."
                           if device == "cuda" else
                           "rise of the process's peak RSS (VmHWM) over its RSS before the first iteration "
                           "(includes the gradients in fwd+bwd)."),
        "CPU ms is the process time of the timed iteration; wall ms is noisier on a shared machine.",
        "",
        "| size | mode | model | peak MiB | wall ms | CPU ms | img/s (wall) | DeiT / model memory | DeiT / model CPU time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in args.pairs:
        vit, deit = PAIRS[pair]
        for size in args.sizes:
            for mode in args.modes:
                ref = next(c for c in configs if c[1] == deit and c[3] == size and c[4] == mode)
                for c in configs:
                    if c[3] != size or c[4] != mode or c[1] not in (vit, deit):
                        continue
                    ratio_m = f"{med(ref, 'peak_mib') / max(med(c, 'peak_mib'), 1e-9):.2f}x" if c is not ref else ""
                    ratio_t = f"{med(ref, 'cpu_ms') / med(c, 'cpu_ms'):.2f}x" if c is not ref else ""
                    lines.append(f"| {size} | {'fwd' if mode == 'fwd' else 'fwd+bwd'} | {c[0]} | "
                                 f"{med(c, 'peak_mib'):.1f} | {med(c, 'wall_ms'):.0f} | {med(c, 'cpu_ms'):.0f} | "
                                 f"{1e3 * args.batch / med(c, 'wall_ms'):.2f} | {ratio_m} | {ratio_t} |")
    if args.before:
        lines += ["", f"`(before)`: the Vision-TTT code of `{args.before}` "
                      f"({subprocess.run(['git', '-C', ROOT, 'rev-parse', '--short', args.before], capture_output=True, text=True).stdout.strip()})."]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
