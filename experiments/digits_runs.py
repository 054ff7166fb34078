"""Real training runs on sklearn's bundled digits (32x32 image folder) through the `ttt-zoo train` command.

    python experiments/digits_runs.py models              # README table: ViT3, H-ViT3, Vision-TTT, DeiT, DeiT -> T5
    python experiments/digits_runs.py variants --seeds 3  # TTT-as-linear-attention ablation (ViT3 baseline, V1, ...)
    python experiments/digits_runs.py inner-steps --seeds 3 --output DIR   # Figure 1: more inner steps at inference
                                                                           # (reuses the variants runs in DIR)

Every run is a separate `python -m ttt_zoo train` process (the command a user types); top-1 is the best epoch's
`eval_top1` from its summary.csv, the time is the wall time of the process. Results go to
experiments/results/digits_{models,variants,inner-steps}.{md,json} (the variants and inner-steps tables also to
docs/digits_{variants,inner-steps}.md), written atomically. This is digits, not ImageNet: it shows that the models
train, nothing more.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
DOCS = os.path.join(ROOT, "docs")
sys.path.insert(0, ROOT)

from ttt_zoo.train.digits import SMALL_MODELS, model_kwargs_flags  # noqa: E402  (the digits_* recipes: one place)
from ttt_zoo.train.recipes import load_recipe  # noqa: E402
from ttt_zoo.fileio import atomic_write  # noqa: E402
VARIANTS = {  # ViT3 mixer options of "TTT with KV binding is secretly linear attention" (Tables 1 and 2)
    "baseline": {},
    "v1": dict(inner_update="last"),
    "v3": dict(inner_update="last", inner_model="linear"),
    "v6": dict(inner_update="last", inner_model="linear", normalize_grad=False),
    "ascent": dict(gradient_ascent=True),
    "q=k": dict(share_qk=True),
}


def _vit3_variant(opts) -> tuple:
    """(recipe, flags, model, model kwargs) of the digits ViT3 with the mixer options ``opts``."""
    recipe = SMALL_MODELS["vit3"][0]
    cfg = load_recipe(recipe)
    kw = dict(cfg["model_kwargs"], mixer_kwargs=opts)
    return recipe, model_kwargs_flags(kw), cfg["model"], kw


def _train(out: str, name: str, recipe: str, flags, epochs: int, lr: float, seed: int, data: str, env) -> dict:
    done = os.path.join(out, name, "digits_run.json")  # a finished run is reused (re-running the script resumes)
    if os.path.isfile(done):
        return json.load(open(done))
    cmd = [sys.executable, "-m", "ttt_zoo", "train", "-c", recipe, "--data-dir", data, "--output", out,
           "--experiment", name, "--epochs", str(epochs), "--lr", str(lr), "--seed", str(seed), *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = list(csv.DictReader(open(os.path.join(out, name, "summary.csv"))))
    best = max(rows, key=lambda r: float(r["eval_top1"]))
    result = dict(run=name, top1=float(best["eval_top1"]), best_epoch=int(best["epoch"]), wall_s=round(wall, 1),
                  img_per_sec=round(statistics.median(float(r["train_img_per_sec"]) for r in rows), 1),
                  folder=os.path.join(out, name), command="ttt-zoo train " + " ".join(cmd[4:]))
    _write(done, json.dumps(result))
    return result


INNER_STEPS_NOTE = ("the best checkpoints of the `variants` runs (trained with 1 inner step) evaluated on the held-out "
                    "split with k inner steps at inference; the inner loss is ViT3's -s/N sum <f(k), v> of every "
                    "mixer's SwiGLU branch on its own (k, v) after the k steps, averaged over mixers and images.")


def _inner_steps(out: str, data: str, a):
    """Figure 1's axes: the trained baseline and V1 runs evaluated with more inner steps at inference: val top-1,
    and the inner loss on the mixers' own (k, v) after the last step (mean over mixers and images)."""
    import torch
    from timm.data import create_dataset
    from timm.utils import accuracy
    from ttt_zoo.analysis import record_inner_losses
    from ttt_zoo.layers.mixer import set_inner_steps
    from ttt_zoo.train.validate import create_eval_model, eval_loader, load_weights
    torch.set_num_threads(a.threads)
    dataset = create_dataset("", root=data, split="validation", is_training=False)
    rows = []
    for key in ("baseline", "v1"):
        for seed in range(a.seeds):
            ckpt = os.path.join(out, f"{key}-s{seed}", "best.safetensors")
            if not os.path.isfile(ckpt):
                raise SystemExit(f"{ckpt} is missing: run `python experiments/digits_runs.py variants --seeds {a.seeds} "
                                 f"--output {out}` first")
            _, _, name, kw = _vit3_variant(VARIANTS[key])
            model = create_eval_model(name, False, 10, 32, kw)
            load_weights(model, ckpt)
            model.eval()
            loader, _ = eval_loader(dataset, model, 120, 32, workers=0)
            for steps in a.steps:
                set_inner_steps(model, steps)
                correct = count = 0.0
                with torch.no_grad(), record_inner_losses(model, steps) as losses:
                    for x, y in loader:
                        correct += accuracy(model(x), y, topk=(1,))[0].item() * x.shape[0]
                        count += x.shape[0]
                curves = torch.stack([c for per_mixer in losses.values() for c in per_mixer])  # (mixers*batches, k+1)
                rows.append(dict(variant=key, seed=seed, steps=steps, top1=correct / count,
                                 inner_loss=curves[:, -1].mean().item(), inner_loss_0=curves[:, 0].mean().item()))
                print(rows[-1], flush=True)
    head = ("| variant | inner steps | top-1 mean ± std (%) | inner loss after the steps (mean over seeds) |\n"
            "|---|---|---|---|\n")
    body = ""
    for key in ("baseline", "v1"):
        for steps in a.steps:
            r = [x for x in rows if x["variant"] == key and x["steps"] == steps]
            tops = [x["top1"] for x in r]
            sd = statistics.stdev(tops) if len(tops) > 1 else 0.0
            body += (f"| {key} | {steps} | {statistics.mean(tops):.2f} ± {sd:.2f} | "
                     f"{statistics.mean(x['inner_loss'] for x in r):.4g} |\n")
    _plot_inner_steps(rows, a.steps, os.path.join(DOCS, "digits_inner_steps.png"))
    return head, body, rows


def _plot_inner_steps(rows, steps, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9, 3.4))
    for key, color in (("baseline", "tab:blue"), ("v1", "tab:orange")):
        loss = [statistics.mean(r["inner_loss"] for r in rows if r["variant"] == key and r["steps"] == s)
                for s in steps]
        top = [[r["top1"] for r in rows if r["variant"] == key and r["steps"] == s] for s in steps]
        ax0.plot(steps, loss, "o-", color=color, label=key)
        ax1.errorbar(steps, [statistics.mean(t) for t in top],
                     yerr=[statistics.stdev(t) if len(t) > 1 else 0 for t in top], fmt="o-", color=color,
                     capsize=3, label=key)
    ax0.set(xlabel="inner steps at inference", ylabel="inner loss on (k, v)", title="inner loss")
    ax1.set(xlabel="inner steps at inference", ylabel="val top-1 (%)", title="accuracy")
    ax0.legend()
    fig.suptitle("ViT3 trained with 1 inner step, digits 32x32 (not ImageNet)", fontsize=9)
    fig.tight_layout()
    _save_fig(fig, path)


def _plot_variants(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(VARIANTS)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9, 3.4))
    tops = [[r["top1"] for r in rows if r["variant"] == k] for k in keys]
    ax0.bar(keys, [statistics.mean(t) for t in tops], yerr=[statistics.stdev(t) if len(t) > 1 else 0 for t in tops],
            capsize=3, color="tab:blue")
    for i, t in enumerate(tops):
        ax0.plot([i] * len(t), t, "k.", ms=4)
    lo = min(min(t) for t in tops)
    ax0.set(ylabel="val top-1 (%)", ylim=(max(0, lo - 5), 100), title="top-1, mean ± std over seeds")
    ax1.bar(keys, [statistics.median(r["img_per_sec"] for r in rows if r["variant"] == k) for k in keys],
            color="tab:green")
    ax1.set(ylabel="train img/s (median epoch)",
            title="training throughput of each run\n(wall clock under the machine's load at the time;\n"
                  "side-by-side speed: experiments/results/variants_throughput.md)")
    ax1.title.set_fontsize(8)
    fig.suptitle("ViT3 inner-loop variants on digits 32x32 (not ImageNet)", fontsize=9)
    fig.tight_layout()
    _save_fig(fig, path)


def _save_fig(fig, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)


def _write(path: str, text: str) -> None:
    atomic_write(path, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=["models", "variants", "inner-steps"])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--ft-epochs", type=int, default=4, help="fine-tuning epochs of the linearized DeiT (T5)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="run folders (default: a new temporary folder)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8],
                   help="inner-steps: the inference-time inner steps to evaluate")
    a = p.parse_args(argv)
    from ttt_zoo.train.digits import make_digits_folder
    out = a.output or tempfile.mkdtemp(prefix="ttt_zoo_digits_")
    os.makedirs(out, exist_ok=True)
    data = make_digits_folder(os.path.join(out, "digits"), img_size=32)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(a.threads), PYTHONPATH=ROOT)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {a.threads}"
    rows = []
    if a.table == "models":
        for key, (recipe, desc) in SMALL_MODELS.items():
            r = _train(out, key, recipe, [], a.epochs, a.lr, 0, data, env)
            rows.append(dict(r, model=desc, epochs=a.epochs))
            print(rows[-1], flush=True)
        deit = os.path.join(out, "deit", "best.safetensors")  # DeiT -> T5: inherit every weight, fine-tune briefly
        r = _train(out, "t5", "digits_t5", ["--initial-checkpoint", deit], a.ft_epochs, a.lr / 4, 0, data, env)
        rows.append(dict(r, model=f"T5 = linearized DeiT above, fine-tuned (new TTT params at 20x lr)",
                         epochs=a.ft_epochs))
        print(rows[-1], flush=True)
        head = "| model | epochs | top-1 (%) | train img/s | wall time (s) |\n|---|---|---|---|---|\n"
        body = "".join(f"| {r['model']} | {r['epochs']} | {r['top1']:.2f} | {r['img_per_sec']:.0f} | {r['wall_s']:.0f} |\n"
                       for r in rows)
    elif a.table == "inner-steps":
        head, body, rows = _inner_steps(out, data, a)
    else:
        for key, opts in VARIANTS.items():
            for seed in range(a.seeds):
                recipe, flags, _, _ = _vit3_variant(opts)
                r = _train(out, f"{key}-s{seed}", recipe, flags, a.epochs, a.lr, seed, data, env)
                rows.append(dict(r, variant=key, seed=seed))
                print(rows[-1], flush=True)
        head = "| variant | mixer options | top-1 mean ± std (%) | seeds | train img/s (median) |\n|---|---|---|---|---|\n"
        body = ""
        for key, opts in VARIANTS.items():
            tops = [r["top1"] for r in rows if r["variant"] == key]
            ips = statistics.median(r["img_per_sec"] for r in rows if r["variant"] == key)
            sd = statistics.stdev(tops) if len(tops) > 1 else 0.0
            body += f"| {key} | {', '.join(f'{k}={v}' for k, v in opts.items()) or '(paper baseline)'} | {statistics.mean(tops):.2f} ± {sd:.2f} | {len(tops)} | {ips:.0f} |\n"
        _plot_variants(rows, os.path.join(DOCS, "digits_variants.png"))
    title = {"models": "Small models trained on sklearn's digits", "variants": "ViT3 inner-loop variants on digits",
             "inner-steps": "More inner steps at inference (Figure 1 axes), ViT3 on digits"}
    md = (f"# {title[a.table]} (32x32, 1,437 train / 360 val images; NOT ImageNet)\n\n"
          f"Machine: {machine}. Generated by `python experiments/digits_runs.py {' '.join(argv or sys.argv[1:])}`; "
          + (INNER_STEPS_NOTE if a.table == "inner-steps" else
             "each row is a real `ttt-zoo train` run; top-1 is the best epoch on the held-out split.") + "\n\n"
          + head + body)
    os.makedirs(RESULTS, exist_ok=True)
    _write(os.path.join(RESULTS, f"digits_{a.table}.md"), md)
    _write(os.path.join(RESULTS, f"digits_{a.table}.json"), json.dumps(dict(machine=machine, rows=rows), indent=1))
    if a.table != "models":  # the linear-attention paper's reproduction also lives in docs/
        _write(os.path.join(DOCS, f"digits_{a.table}.md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
