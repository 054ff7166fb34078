"""Where the time goes: torch.profiler operator breakdown of TTT models next to DeiT-T, on CPU or CUDA.

For each (model, resolution) the script runs warm-up calls, then profiles ``--iters`` calls and writes the top
operators by self time (with their share of the total) to a markdown file, so the cost of the TTT inner step can be
compared with the GEMMs, convolutions and elementwise work around it.

    python tools/profile_model.py                                     # CPU, vit3_tiny + deit_tiny, 224 512 1024
    python tools/profile_model.py --device cuda --amp bf16 --train    # the GPU training gap
    python tools/profile_model.py --models vit3_tiny hvit3_tiny --res 224 --top 15
"""
import argparse
import os
import platform

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def profile_one(name: str, res: int, device: str, train: bool, amp, iters: int, top: int, batch: int):
    import timm
    import ttt_zoo  # noqa: F401
    from torch.profiler import ProfilerActivity, profile

    kw = dict(dynamic_img_size=True) if name.startswith("deit") else {}
    model = timm.create_model(name, num_classes=1000, **kw).to(device).train(train)
    x = torch.randn(batch, 3, res, res, device=device)
    ctx = torch.autocast(device, dtype=amp) if amp is not None else torch.autocast(device, enabled=False)

    def step():
        with ctx:
            if train:
                model(x).float().sum().backward()
                model.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    model(x)

    for _ in range(2):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    rows = [(e.key, getattr(e, attr) / iters / 1e3, 100.0 * getattr(e, attr) / total, e.count // iters)
            for e in events[:top]]
    return total / iters / 1e3, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["vit3_tiny", "deit_tiny_patch16_224"])
    ap.add_argument("--res", type=int, nargs="+", default=[224, 512, 1024])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"])
    ap.add_argument("--train", action="store_true", help="profile forward+backward instead of inference")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.amp]
    mode = "fwd+bwd" if a.train else "fwd"
    out = a.out or os.path.join(ROOT, "tools", "results", f"profile_{a.device}_{mode.replace('+', '_')}.md")
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"{platform.machine()}, {a.threads} thread(s)"
    lines = [f"# Operator profile ({a.device}, {mode}, batch {a.batch}, amp {a.amp})", "",
             f"`python tools/profile_model.py {' '.join(os.sys.argv[1:])}`; torch {torch.__version__}, {where}; "
             f"load average before the run {' / '.join(f'{x:.2f}' for x in os.getloadavg())}. Self time per call, "
             f"averaged over {a.iters} profiled calls after 2 warm-ups; the profiler adds overhead per operator, so "
             "absolute times run above un-profiled latency; compare shares.", ""]
    for res in a.res:
        for name in a.models:
            total, rows = profile_one(name, res, a.device, a.train, amp, a.iters, a.top, a.batch)
            print(f"{name} @ {res}: {total:.1f} ms per call", flush=True)
            lines += [f"## {name} @ {res}x{res}: {total:.1f} ms self time per call", "",
                      "| operator | ms / call | share | calls / call |", "|---|---:|---:|---:|"]
            lines += [f"| `{k}` | {ms:.2f} | {pct:.1f}% | {n} |" for k, ms, pct, n in rows]
            lines.append("")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
