#!/usr/bin/env python
"""The SD3.5-T5 recipe end to end on a tiny config (CPU, minutes), with ``ttt-zoo train --task sd3``.

1. a synthetic captioned image folder (coloured squares / circles; ``metadata.jsonl``);
2. a tiny softmax SD3 pipeline (``ttt_zoo.sd3.tiny``) whose transformer is first trained on it (``--softmax``:
   the "pretrained" teacher);
3. linearized (the paper's layout: attn2 of the 3 dual blocks + joint attn of the last 5 of 6) and fine-tuned
   (a) plainly as in the paper, (b) with distillation from the teacher, and, for reference, (c) the softmax model
   fine-tuned for the same steps (SD3.5-FT);
4. eval flow loss and MSE of the prediction to the teacher's (fixed noise / timesteps) before and after.

    PYTHONPATH=. python experiments/sd3_finetune_tiny.py --out /tmp/sd3_tiny  # -> experiments/results/sd3_finetune.md
"""
import argparse
import csv
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

COLORS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 230)}
BGS = {"black": (0, 0, 0), "white": (255, 255, 255)}
POS = {"left": (0.3, 0.5), "right": (0.7, 0.5), "top": (0.5, 0.3), "bottom": (0.5, 0.7)}


def make_data(root: str, n: int, size: int, seed: int) -> None:
    from PIL import Image
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    rows = []
    yy, xx = np.mgrid[0:size, 0:size] / size
    for i in range(n):
        color, bg, pos = (rng.choice(list(d)) for d in (COLORS, BGS, POS))
        shape = rng.choice(["square", "circle"])
        cx, cy = POS[pos]
        r = rng.uniform(0.12, 0.2)
        mask = (np.maximum(abs(xx - cx), abs(yy - cy)) < r) if shape == "square" else ((xx - cx) ** 2 + (yy - cy) ** 2
                                                                                         < r * r)
        img = np.empty((size, size, 3), np.uint8)
        img[:] = BGS[bg]
        img[mask] = COLORS[color]
        name = f"{i:04d}.png"
        Image.fromarray(img).save(os.path.join(root, name))
        rows.append({"file_name": name, "text": f"a {color} {shape} on {bg} {pos}"})
    with open(os.path.join(root, "metadata.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def train(argv):
    from ttt_zoo.train.trainer import main
    main(argv)


def summary(folder):
    with open(os.path.join(folder, "summary.csv")) as f:
        return list(csv.DictReader(f))


def before(common, pipeline):
    """Eval of the freshly linearized model (no training) through the same SD3Task code."""
    from ttt_zoo.train.args import parse_args
    from ttt_zoo.train.distributed import DistInfo
    args, task_cls = parse_args(["--task", "sd3", "--sd3-pipeline", pipeline] + common)
    task = task_cls(args, DistInfo(0, 0, 1, torch.device("cpu"), True))
    model = task.build_model()
    _, loader = task.build_loaders()
    return task.evaluate(model.eval(), loader)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/sd3_tiny")
    p.add_argument("--teacher-epochs", type=int, default=30)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--ttt-lr-scale", type=float, default=10.0)
    p.add_argument("--distill-weight", type=float, default=1.0)
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                     "sd3_finetune.md"))
    a = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    from ttt_zoo.sd3.tiny import tiny_sd3_pipeline
    os.makedirs(a.out, exist_ok=True)
    data, evald = os.path.join(a.out, "train"), os.path.join(a.out, "eval")
    make_data(data, 128, 32, 0)
    make_data(evald, 16, 32, 1)
    init = os.path.join(a.out, "sd3_init")
    pipe = tiny_sd3_pipeline(seed=0)
    pipe.save_pretrained(init)
    common = ["--data-dir", data, "--eval-data-dir", evald, "--img-size", "32", "-b", "16", "--opt", "adamw",
              "--weight-decay", "1e-4", "--sched", "step", "--decay-rate", "1.0", "--warmup-epochs", "0",
              "--cache-text-embeddings", "--cache-latents", "--max-sequence-length", "16", "-j", "0",
              "--log-interval", "1000", "--output", os.path.join(a.out, "runs"), "--device", "cpu"]

    # 1. the "pretrained" softmax teacher
    train(["--task", "sd3", "--softmax", "--sd3-pipeline", init, "--lr", "2e-3", "--epochs", str(a.teacher_epochs),
           "--experiment", "teacher"] + common)
    from safetensors.torch import load_file
    pipe.transformer.load_state_dict(load_file(os.path.join(a.out, "runs", "teacher", "last.safetensors")))
    teacher_dir = os.path.join(a.out, "sd3_pretrained")
    pipe.save_pretrained(teacher_dir)
    teacher_rows = summary(os.path.join(a.out, "runs", "teacher"))

    # 2. before fine-tuning, 3. the fine-tunes
    ft = common + ["--lr", str(a.lr), "--epochs", str(a.epochs)]
    res = {"before": before(ft, teacher_dir)}
    t5 = ["--ttt-lr-scale", str(a.ttt_lr_scale)]
    runs = {"t5_plain": t5 + ["--model-ema", "--model-ema-decay", "0.95", "--grad-checkpointing"],
            "t5_distill": t5 + ["--distill-weight", str(a.distill_weight)],
            "softmax_ft": ["--softmax"]}
    for name, extra in runs.items():
        train(["--task", "sd3", "--sd3-pipeline", teacher_dir, "--experiment", name] + ft + extra)
        res[name] = summary(os.path.join(a.out, "runs", name))
    f = lambda x: f"{float(x):.4f}"  # noqa: E731
    b = res["before"]
    lines = [
        "# SD3.5-T5 fine-tune on the tiny config", "",
        f"`PYTHONPATH=. python experiments/sd3_finetune_tiny.py` (CPU, 1 thread, {time.time() - t0:.0f} s in all). Tiny SD3.5-Medium-"
        f"shaped transformer (6 blocks, 3 dual-attention, width 32, 4 heads x 8, RMS qk-norm), 32x32 images -> 16x16 "
        f"latents (8x8 = 64 image tokens + 32 text tokens), 128 synthetic captioned images (train), 16 (eval).",
        f"Teacher: the softmax transformer trained {a.teacher_epochs} epochs ({a.teacher_epochs * 8} steps, AdamW lr 2e-3) "
        f"from random init: eval flow loss {f(teacher_rows[0]['eval_loss'])} (epoch 0) -> "
        f"{f(teacher_rows[-1]['eval_loss'])}.",
        f"Linearized with the paper's layout (attn2 of blocks 0-2 + joint attn of blocks 1-5: 8 TTT layers), then "
        f"fine-tuned {a.epochs} epochs ({a.epochs * 8} steps, batch 16, AdamW lr {a.lr:g}, wd 1e-4, constant lr; "
        f"new TTT tensors at `--ttt-lr-scale {a.ttt_lr_scale:g}`). Eval: fixed noise and timestep per eval image; `mse_teacher` = mean squared difference of "
        f"the velocity prediction to the softmax teacher's on the same inputs.", "",
        "| run | train loss, epoch 0 -> last | eval flow loss | eval MSE to teacher |", "| --- | --- | --- | --- |",
        f"| teacher (softmax, pretrained) | - | {f(teacher_rows[-1]['eval_loss'])} | 0 |",
        f"| SD3.5-T5 before fine-tuning | - | {f(b['loss'])} | {f(b['mse_teacher'])} |"]
    for name, label in (("t5_plain", "SD3.5-T5 fine-tuned (paper: flow loss only; + EMA, grad checkpointing)"),
                        ("t5_distill", f"SD3.5-T5 fine-tuned, flow + {a.distill_weight:g} x distillation"),
                        ("softmax_ft", "softmax fine-tuned the same steps (SD3.5-FT)")):
        r = res[name]
        lines.append(f"| {label} | {f(r[0]['train_loss'])} -> {f(r[-1]['train_loss'])} | {f(r[-1]['eval_loss'])} | "
                     f"{f(r[-1]['eval_mse_teacher'])} |")
        if "eval_ema_loss" in r[-1]:
            lines.append(f"| ... its EMA (decay 0.95) | - | {f(r[-1]['eval_ema_loss'])} | "
                         f"{f(r[-1]['eval_ema_mse_teacher'])} |")
    gap0 = float(b["mse_teacher"])
    floor = float(res["softmax_ft"][-1]["eval_mse_teacher"])  # how far fine-tuning alone moves the softmax model
    lines.append("")
    for name in ("t5_plain", "t5_distill"):
        after = float(res[name][-1]["eval_mse_teacher"])
        lines.append(f"- {name}: MSE to the teacher {gap0:.4f} -> {after:.4f} ({100 * (1 - after / gap0):.0f}% of the "
                     f"gap closed; the softmax model fine-tuned the same way ends {floor:.4f} from the teacher).")
    from ttt_zoo.fileio import atomic_write
    atomic_write(a.results, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
