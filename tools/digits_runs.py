"""Real training runs on sklearn's bundled digits (32x32 image folder) through the `ttt-zoo train` command.

    python tools/digits_runs.py models                 # README table: ViT3, H-ViT3, Vision-TTT, DeiT, DeiT -> T5
    python tools/digits_runs.py variants --seeds 3     # TTT-as-linear-attention ablation (ViT3 baseline, V1, V3, V6, ...)

Every run is a separate `python -m ttt_zoo train` process (the command a user types); top-1 is the best epoch's
`eval_top1` from its summary.csv, the time is the wall time of the process. Results go to tools/results/digits_*.md
and .json (written atomically). This is digits, not ImageNet: it shows that the models train, nothing more.
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
RESULTS = os.path.join(ROOT, "tools", "results")
sys.path.insert(0, ROOT)

from ttt_zoo.train.digits import SMALL_MODELS, TRAIN_FLAGS  # noqa: E402  (one place for the digits settings)
VARIANTS = {  # ViT3 mixer options of "TTT with KV binding is secretly linear attention" (Tables 1 and 2)
    "baseline": {},
    "v1": dict(inner_update="last"),
    "v3": dict(inner_update="last", inner_model="linear"),
    "v6": dict(inner_update="last", inner_model="linear", normalize_grad=False),
    "ascent": dict(gradient_ascent=True),
    "q=k": dict(share_qk=True),
}


def _train(out: str, name: str, flags, epochs: int, lr: float, seed: int, data: str, env) -> dict:
    done = os.path.join(out, name, "digits_run.json")  # a finished run is reused (re-running the script resumes)
    if os.path.isfile(done):
        return json.load(open(done))
    cmd = [sys.executable, "-m", "ttt_zoo", "train", "--data-dir", data, "--output", out, "--experiment", name,
           *TRAIN_FLAGS, "--epochs", str(epochs), "--lr", str(lr), "--seed", str(seed), *flags]
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


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=["models", "variants"])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--ft-epochs", type=int, default=4, help="fine-tuning epochs of the linearized DeiT (T5)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None, help="run folders (default: a new temporary folder)")
    a = p.parse_args(argv)
    from ttt_zoo.train.digits import make_digits_folder
    out = a.output or tempfile.mkdtemp(prefix="ttt_zoo_digits_")
    os.makedirs(out, exist_ok=True)
    data = make_digits_folder(os.path.join(out, "digits"), img_size=32)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(a.threads), PYTHONPATH=ROOT)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {a.threads}"
    rows = []
    if a.table == "models":
        for key, (flags, desc) in SMALL_MODELS.items():
            r = _train(out, key, flags, a.epochs, a.lr, 0, data, env)
            rows.append(dict(r, model=desc, epochs=a.epochs))
            print(rows[-1], flush=True)
        deit = os.path.join(out, "deit", "best.safetensors")  # DeiT -> T5: inherit every weight, fine-tune briefly
        deit_flags = SMALL_MODELS["deit"][0]  # ("--model", NAME, "--model-kwargs", ...)
        lin = ["--linearize-from", deit_flags[1], "--initial-checkpoint", deit, *deit_flags[2:]]
        r = _train(out, "t5", lin, a.ft_epochs, a.lr / 4, 0, data, env)
        rows.append(dict(r, model=f"T5 = linearized DeiT above, fine-tuned (new TTT params at 20x lr)",
                         epochs=a.ft_epochs))
        print(rows[-1], flush=True)
        head = "| model | epochs | top-1 (%) | train img/s | wall time (s) |\n|---|---|---|---|---|\n"
        body = "".join(f"| {r['model']} | {r['epochs']} | {r['top1']:.2f} | {r['img_per_sec']:.0f} | {r['wall_s']:.0f} |\n"
                       for r in rows)
    else:
        for key, opts in VARIANTS.items():
            for seed in range(a.seeds):
                flags = [*SMALL_MODELS["vit3"][0], f"mixer_kwargs={opts!r}"]
                r = _train(out, f"{key}-s{seed}", flags, a.epochs, a.lr, seed, data, env)
                rows.append(dict(r, variant=key, seed=seed))
                print(rows[-1], flush=True)
        head = "| variant | mixer options | top-1 mean ± std (%) | seeds | train img/s (median) |\n|---|---|---|---|---|\n"
        body = ""
        for key, opts in VARIANTS.items():
            tops = [r["top1"] for r in rows if r["variant"] == key]
            ips = statistics.median(r["img_per_sec"] for r in rows if r["variant"] == key)
            sd = statistics.stdev(tops) if len(tops) > 1 else 0.0
            body += f"| {key} | {', '.join(f'{k}={v}' for k, v in opts.items()) or '(paper baseline)'} | {statistics.mean(tops):.2f} ± {sd:.2f} | {len(tops)} | {ips:.0f} |\n"
    title = {"models": "Small models trained on sklearn's digits", "variants": "ViT3 inner-loop variants on digits"}
    md = (f"# {title[a.table]} (32x32, 1,437 train / 360 val images; NOT ImageNet)\n\n"
          f"Machine: {machine}. Generated by `python tools/digits_runs.py {' '.join(argv or sys.argv[1:])}`; "
          f"each row is a real `ttt-zoo train` run; top-1 is the best epoch on the held-out split.\n\n"
          + head + body)
    os.makedirs(RESULTS, exist_ok=True)
    _write(os.path.join(RESULTS, f"digits_{a.table}.md"), md)
    _write(os.path.join(RESULTS, f"digits_{a.table}.json"), json.dumps(dict(machine=machine, rows=rows), indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
