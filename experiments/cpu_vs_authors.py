"""ViT3-T training on the CPU against the authors' block (issue 39 item 4): experiments/results/cpu_vs_authors.md.

The authors' code (LeapLabTHU/ViTTT, ``vittt/models/vittt.py`` + ``ttt_block.py``) is not shipped: pass the folder of
a local checkout.  A short registering module, written to a temporary folder, puts it on the path and builds
their ``VisionTransformer`` for ``vittt_tiny`` directly (the current timm's ``build_model_with_cfg`` takes no
``default_cfg``), and registers ``vit3_tiny_keep`` (ours, storing what theirs stores); ``ttt-zoo bench --import``
then runs our ``vit3_tiny``, their ``vittt_tiny`` and ``vit3_tiny_keep`` side by side in one run (same config: patch
16, 192 wide, 12 blocks, 6 heads, inner scale 1/3; fresh subprocesses, interleaved repeats, medians).

    python experiments/cpu_vs_authors.py /path/to/ViTTT [--threads 1] [--repeats 5] [--batch-size 8]
"""
import argparse
import csv
import datetime
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "results" / "cpu_vs_authors.md"

SHIM = '''import sys
sys.path.insert(0, {folder!r})
import models.vittt as _v  # noqa: E402  (registers vittt_tiny with timm)
_TIMM_ONLY = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")
_v._create_vision_transformer = lambda variant, pretrained=False, default_cfg=None, **kw: _v.VisionTransformer(
    **{{k: a for k, a in kw.items() if k not in _TIMM_ONLY}})

from timm.models import register_model  # noqa: E402
from ttt_zoo.models.vit3 import vit3_tiny  # noqa: E402


@register_model
def vit3_tiny_keep(pretrained=False, **kw):
    """ours, keeping what the authors' block keeps: no recompute in the mixer (qkv output) or the MLP (GELU)"""
    model = vit3_tiny(pretrained, **kw)
    for m in model.modules():
        for attr in ("recompute", "recompute_act"):
            if hasattr(m, attr):
                setattr(m, attr, False)
    return model
'''


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("authors", type=Path, help="a checkout of LeapLabTHU/ViTTT (the folder holding vittt/)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-bench-iter", type=int, default=3)
    args = ap.parse_args()
    folder = args.authors.resolve() / "vittt"
    if not (folder / "models" / "ttt_block.py").is_file():
        print(f"error: {folder}/models/ttt_block.py not found; pass a checkout of LeapLabTHU/ViTTT", file=sys.stderr)
        sys.exit(2)
    authors_rev = subprocess.run(["git", "-C", str(args.authors), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip() or "(not a git checkout)"
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    rev = _git("rev-parse", "--short", "HEAD")  # the code measured (taken before the run: HEAD may move meanwhile)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels/vit3_ttt", "ttt_zoo/layers", "ttt_zoo/models"],
                           cwd=REPO, capture_output=True, text=True).stdout  # not stripped: "XY path" per line
    dirty = f" + uncommitted changes in {', '.join(ln[3:] for ln in dirty.splitlines() if ln.strip())}" if dirty else ""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "authors_vittt.py").write_text(SHIM.format(folder=str(folder)))
        results = Path(tmp) / "results.csv"
        cmd = ["ttt-zoo", "bench", "--import", "authors_vittt", "--model", "vit3_tiny", "--peers", "vittt_tiny", "vit3_tiny_keep",
               "--img-size", "224", "-b", str(args.batch_size), "--bench", "train", "--device", "cpu",
               "--threads", str(args.threads), "--num-warm-iter", "1", "--num-bench-iter", str(args.num_bench_iter),
               "--repeats", str(args.repeats), "--backend", "torch", "--results-file", str(results)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])))
        exe = str(Path(sys.executable).with_name("ttt-zoo"))
        subprocess.run([exe, *cmd[1:]], env=env, check=True, cwd=REPO)
        rows = {r["model"]: r for r in csv.DictReader(results.open())}
    ours, theirs, keep = (float(rows[m]["train_step_time"]) for m in ("vit3_tiny", "vittt_tiny", "vit3_tiny_keep"))
    ours_cpu, theirs_cpu, keep_cpu = (float(rows[m]["train_cpu_time"])
                                      for m in ("vit3_tiny", "vittt_tiny", "vit3_tiny_keep"))
    ours_mb, theirs_mb, keep_mb = (float(rows[m]["train_peak_mem_mb"])
                                   for m in ("vit3_tiny", "vittt_tiny", "vit3_tiny_keep"))
    load_after = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    import timm
    import torch
    text = f"""<!-- written by experiments/cpu_vs_authors.py at commit {rev} \
({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC) -->
# ViT3-T training on the CPU against the authors' block (issue 39 item 4)

`python experiments/cpu_vs_authors.py <ViTTT checkout> --threads {args.threads} --repeats {args.repeats} \
--batch-size {args.batch_size} --num-bench-iter {args.num_bench_iter}`, which ran
`PYTHONPATH=<shim> {' '.join(cmd[:-1])} <tmp>/results.csv`.

Machine: {cpu}, {os.cpu_count()} cores, {args.threads} torch thread(s); torch {torch.__version__}, timm \
{timm.__version__}; shared with other jobs: load average before {load}, after {load_after}.
Ours: the zoo at {rev}{dirty}, backend torch.
Theirs: LeapLabTHU/ViTTT at {authors_rev} (`vittt/models/vittt.py` + `ttt_block.py`, unchanged, built directly).
fp32, batch {args.batch_size}, 224 px, forward + cross-entropy + backward (no optimizer step); every (model, repeat)
a fresh subprocess, {args.repeats} interleaved repeats, each 1 warm-up + {args.num_bench_iter} timed steps; the
medians.

| model | ms / step (median, wall) | CPU ms / step (median) | training peak-RSS growth, MB (median) |
|---|---:|---:|---:|
| vit3_tiny (ours, defaults) | {ours:.0f} | {ours_cpu:.0f} | {ours_mb:.0f} |
| vit3_tiny_keep (ours, keeping the projection output and the MLP activation) | {keep:.0f} | {keep_cpu:.0f} | {keep_mb:.0f} |
| vittt_tiny (authors) | {theirs:.0f} | {theirs_cpu:.0f} | {theirs_mb:.0f} |
| **authors' / ours (defaults)** | **{theirs / ours:.3f}x** | **{theirs_cpu / ours_cpu:.3f}x** | {theirs_mb / ours_mb:.2f}x |
| **authors' / ours (keeping)** | **{theirs / keep:.3f}x** | **{theirs_cpu / keep_cpu:.3f}x** | {theirs_mb / keep_mb:.2f}x |

Target (issue 39): at least 1.1x on the wall time: {'met' if theirs / ours >= 1.1 else 'not met'} with the \
defaults, {'met' if theirs / keep >= 1.1 else 'not met'} keeping, in this run.
Ours by default recomputes in the backward what the authors' block keeps: the qkv projection's output (one GEMM,
C x (3C + 3d) per token: the mixer's `recompute`) and the MLP's GELU (`recompute_act`), so that training memory
stays at or below DeiT-T's from 512 px (issue 16). `vit3_tiny_keep` (registered by this script) sets both to
False: it keeps those two as the authors' block does (and still far less memory than theirs: every inner-step
intermediate is recomputed).
CPU time is the process's own user + system time per step: on a loaded machine (load average above the core
count) the wall time also counts the time the step waited for a core.
"""
    from ttt_zoo.fileio import atomic_write
    atomic_write(str(OUT), text)
    print(text)


if __name__ == "__main__":
    main()
