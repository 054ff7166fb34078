"""Training step under bf16 autocast against fp32, on the CPU, family by family beside DeiT-T (issue 48):
experiments/results/cpu_bf16_ratio.md.

Every (model, dtype) is one ``torch.utils.benchmark.Timer`` measurement of a few training steps (forward under
``torch.autocast("cpu", torch.bfloat16)`` or not, loss, backward); the repeats are interleaved (round r times every
model in fp32 then in bf16, so both see the same load); medians with min-max; the bf16/fp32 ratio per model is the
median of the per-round ratios, and "/ DeiT-T" divides it by DeiT-T's (the issue's target: every family <= 1.5x).

    python experiments/cpu_bf16_ratio.py [--batch-size 8] [--repeats 5] [--threads 1]
    python experiments/cpu_bf16_ratio.py --profile t5_tiny   # where a bf16 step spends its time (torch.profiler)
"""
import argparse
import datetime
import importlib.util
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "--tree" in sys.argv:  # measure another checkout's package (e.g. a git worktree of the "before" commit)
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()))

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.benchmark as benchmark  # noqa: E402

import ttt_zoo  # noqa: F401,E402


def _this_checkouts(module: str, path: Path):
    spec = importlib.util.spec_from_file_location(module, path)
    mod = sys.modules[module] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# this checkout's input builder and atomic write, whichever package --tree measures
_launches = _this_checkouts("launch_counter", REPO / "ttt_zoo" / "bench" / "launches.py")
is_conditioned, model_inputs = _launches.is_conditioned, _launches.model_inputs
OUT = REPO / "experiments" / "results" / "cpu_bf16_ratio.md"
PEER = "deit_tiny_patch16_224"
MODELS = [PEER, "vit3_tiny", "hvit3_tiny", "t5_tiny", "t5_plus_tiny", "visionttt_tiny", "vit3_tiny_v3", "dit5_s_2",
          "dit_s_2"]
DIT_PEER = "dit_s_2"  # DiT5-S/2's own softmax peer, for reference
TARGET = 1.5


def make_step(name: str, batch: int, bf16: bool):
    torch.manual_seed(0)
    model = timm.create_model(name).train()
    size = model.pretrained_cfg["input_size"][-1]  # 224 px; 32-px latents (256-px images) for DiT
    inputs = model_inputs(model, size, batch)
    target = torch.randint(0, 1000, (batch,)) if not is_conditioned(model) else torch.randn_like(inputs[0])

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(*inputs)
            if is_conditioned(model):
                loss = F.mse_loss(out[:, :target.shape[1]].float(), target)
            else:
                loss = F.cross_entropy(out.float(), target)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up (allocations, oneDNN primitive caches)
    return step


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def profile(name: str, batch: int, rows: int) -> None:
    """Self CPU time by op of one bf16 step and one fp32 step, with the input dtypes: which ops run in fp32."""
    from torch.profiler import ProfilerActivity, profile as prof
    for bf16 in (False, True):
        step = make_step(name, batch, bf16)
        with prof(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            step()
        print(f"\n== {name} {'bf16 autocast' if bf16 else 'fp32'}, batch {batch}: self CPU time by op and input dtype")
        print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                               max_name_column_width=40, max_shapes_column_width=70))


GEMMS = {"mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward",
         "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
CASTS = {"_to_copy", "copy_", "clone"}


def dtype_shares(name: str, batch: int) -> dict:
    """Where one bf16-autocast step's time goes, by op kind (GEMM, cast/copy, other) and the dtype it computes in
    (each aten op timed below autocast, so the dtype is the one autocast chose)."""
    import time
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Timed(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            name = func._schema.name.split("::")[-1]
            kind = "GEMM" if name in GEMMS else "cast/copy" if name in CASTS else "other"
            dt = next((str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor)), "-")
            self.seconds[kind, dt] += time.perf_counter() - t0
            return out

    step = make_step(name, batch, True)
    with Timed() as t:
        step()
    total = sum(t.seconds.values())
    return {k: v / total for k, v in t.seconds.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=MODELS)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=2, help="training steps per measurement")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", metavar="MODEL", help="profile one model's bf16 and fp32 steps instead")
    ap.add_argument("--rows", type=int, default=25, help="--profile: rows of the table")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--shares", action="store_true", help="also: where each model's bf16 step spends its time")
    ap.add_argument("--tree", type=Path, help="measure this checkout's package (e.g. a worktree of an older commit)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        profile(args.profile, args.batch_size, args.rows)
        return 0
    tree = args.tree or REPO
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels", "ttt_zoo/layers", "ttt_zoo/models"],
                           cwd=tree, capture_output=True, text=True).stdout.split("\n")
    dirty = sorted(ln[3:] for ln in dirty if ln.strip())
    load_before = _load()
    steps = {(m, bf16): make_step(m, args.batch_size, bf16) for m in args.models for bf16 in (False, True)}
    times = {k: [] for k in steps}
    loads = []
    for r in range(args.repeats):
        for m in args.models:
            for bf16 in (False, True):
                t = benchmark.Timer("step()", globals={"step": steps[m, bf16]}, num_threads=args.threads)
                times[m, bf16].append(t.timeit(args.steps).median / 1.0)
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{args.repeats}: load {loads[-1]:.2f}", flush=True)
    ratio = {m: statistics.median(b / f for f, b in zip(times[m, False], times[m, True])) for m in args.models}
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    isa = ", ".join(f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f" {f}" in flags) or "no bf16 instructions"
    ms = lambda v: f"{statistics.median(v) * 1e3:.0f} ({min(v) * 1e3:.0f}-{max(v) * 1e3:.0f})"  # noqa: E731
    lines = [f"<!-- written by experiments/cpu_bf16_ratio.py at commit {rev} "
             f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC) -->",
             "# Training step under bf16 autocast vs fp32 on the CPU, beside DeiT-T (issue 48)", "",
             f"`python experiments/cpu_bf16_ratio.py --batch-size {args.batch_size} --repeats {args.repeats} "
             f"--steps {args.steps} --threads {args.threads}{' --shares' if args.shares else ''}`", "",
             f"Machine: {cpu} ({isa}), {os.cpu_count()} cores shared with other jobs, {args.threads} torch "
             f"thread(s); torch {torch.__version__}, timm {timm.__version__}. Load average before {load_before}, "
             f"1-min load after each round {', '.join(f'{x:.1f}' for x in loads)}, after {_load()}.",
             f"Code: {rev}" + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else "") + ".", "",
             f"One training step (forward + loss + backward, no optimizer step), batch {args.batch_size}, 224 px "
             "(DiT: 32-px latents, the 256-px images DiT-S/2 is sold for, with timesteps and labels); autocast wraps",
             "the forward and the loss. Each cell: the median ms per step over the rounds (min-max); "
             f"{args.repeats} interleaved rounds of {args.steps} steps per measurement. bf16/fp32: median of the "
             "per-round ratios; / DeiT-T: that ratio over DeiT-T's.", "",
             "| model | fp32 ms | bf16 autocast ms | bf16 / fp32 | / DeiT-T's ratio | within 1.5x |",
             "|---|---:|---:|---:|---:|---|"]
    for m in args.models:
        rel = ratio[m] / ratio[PEER] if PEER in ratio else float("nan")
        lines.append(f"| {m} | {ms(times[m, False])} | {ms(times[m, True])} | {ratio[m]:.2f} | {rel:.2f} | "
                     f"{'yes' if rel <= TARGET else '**no**'} |")
    if args.shares:
        lines += ["", "Where the bf16-autocast step's time goes (share of the time in aten ops, each op timed below "
                  "autocast: the dtype it computes in; one step, batch "
                  f"{args.batch_size}, timed separately after the rounds):", "",
                  "| model | GEMM bf16 | GEMM fp32 | cast/copy | other bf16 | other fp32 |", "|---|---:|---:|---:|---:|---:|"]
        for m in args.models:
            sh = dtype_shares(m, args.batch_size)
            pick = lambda kind, dt: sum(v for (k, d), v in sh.items() if k == kind and (dt is None or d == dt))  # noqa
            lines.append(f"| {m} | {pick('GEMM', 'bfloat16'):.0%} | {pick('GEMM', 'float32'):.0%} | "
                         f"{pick('cast/copy', None):.0%} | {pick('other', 'bfloat16'):.0%} | "
                         f"{pick('other', 'float32'):.0%} |")
    text = "\n".join(lines) + "\n"
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
