"""Issue 39, "measure right": the profile's time sum, old method against new, on a real CPU profile of one ViT3
block (vit3_tiny, depth 1, 64 px, one training step and one inference step) and torch's own table total.

    python experiments/issue39_profile_sum.py   # -> experiments/results/issue39_profile_sum.md

Old (before 3a851de): sum of ``self_device_time_total`` (CUDA) / ``self_cpu_time_total`` (CPU) over every row of
``key_averages()``.  New: ``ttt_zoo.bench.profiling`` (device rows only / every row's self CPU time).  On the CPU the
self CPU times never overlap, so old and new agree with torch's table; the double count is a device-time one: a
kernel's time is in its own row and again in its launch row (``cudaLaunchKernel``), so the old CUDA sum was about
twice the truth (26.6 ms of device time in a 56.2 ms step in the surviving H200 profile).
"""
import os
import re

import timm
import torch
from torch.profiler import ProfilerActivity, profile

import ttt_zoo  # noqa: F401
from ttt_zoo.bench.profiling import cpu_time_us, device_time_us

UNIT = {"us": 1.0, "ms": 1e3, "s": 1e6}


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = timm.create_model("vit3_tiny", depth=1, img_size=64)
    x = torch.randn(1, 3, 64, 64)
    lines = ["# Profile sums, old method against new (one ViT3 block, CPU)", "",
             "`python experiments/issue39_profile_sum.py`; vit3_tiny depth 1, 64 px, batch 1, 1 thread, torch "
             + torch.__version__ + ".", "",
             "| step | rows | old sum (ms) | new CPU sum (ms) | torch table 'Self CPU time total' (ms) | "
             "old device sum over every row (ms) | new device sum (ms) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for phase in ("inference", "training"):
        model.train(phase == "training")

        def step():
            if phase == "training":
                model(x).sum().backward()
            else:
                with torch.no_grad():
                    model(x)
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        rows = prof.key_averages()
        m = re.search(r"Self CPU time total: ([\d.]+)(us|ms|s)\b", rows.table())
        table_ms = float(m.group(1)) * UNIT[m.group(2)] / 1e3
        old = sum(e.self_cpu_time_total for e in rows if e.self_cpu_time_total > 0) / 1e3
        old_dev = sum(e.self_device_time_total for e in rows) / 1e3
        lines.append(f"| {phase} | {len(rows)} | {old:.3f} | {cpu_time_us(rows) / 1e3:.3f} | {table_ms:.3f} | "
                     f"{old_dev:.3f} | {device_time_us(rows) / 1e3:.3f} |")
    lines += ["", "On the CPU the old and the new sums agree (self CPU times do not overlap); the device double count "
              "is shown by tests/test_bench.py::test_profile_sums_each_kernel_once (kineto-shaped rows: old 540 us, "
              "new 180 us = the kernels and copies once)."]
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "issue39_profile_sum.md")
    from ttt_zoo.fileio import atomic_write
    atomic_write(out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
