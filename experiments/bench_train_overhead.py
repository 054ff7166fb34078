"""Overhead of ``ttt-zoo train`` over a bare training loop: images/s side by side, in one process.

Both loops use the same model (timm ``create_model``), data (timm ``create_dataset`` image folder, eval transform,
torch ``DataLoader`` with the same batch / workers), loss (cross-entropy) and optimizer (timm ``create_optimizer_v2``),
and the same autocast.  The bare loop is: load batch -> forward -> loss -> zero_grad -> backward -> step.  The
trainer runs with augmentation, smoothing and evaluation off (``--no-aug --smoothing 0 --val-split ''``), so the
difference is the trainer's own work (scheduler, accumulation bookkeeping, logging, DDP-ready plumbing).
images/s is per epoch (loader included); the first epoch of each run is warm-up and left out; repeats alternate
bare / trainer and the medians are compared.  Writes a Markdown table (default experiments/results/train_overhead.md).

    python experiments/bench_train_overhead.py --model vit3_tiny --img-size 224 -b 128 --epochs 4 --repeats 3
    python experiments/bench_train_overhead.py --model vit3_tiny --model-kwargs depth=1 embed_dim=32 num_heads=2 \\
        --img-size 32 -b 32 --epochs 2 --repeats 1 --device cpu --out /tmp/overhead.md   # a quick check
"""
import argparse
import csv
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bare_loop(a, data_dir, device):
    """images/s of each epoch of the plainest loop over the same components."""
    import timm
    from timm.data import create_dataset, create_transform, resolve_data_config
    from timm.optim import create_optimizer_v2
    import ttt_zoo  # noqa: F401 - registers the models
    torch.manual_seed(a.seed)
    model = timm.create_model(a.model, num_classes=10, img_size=a.img_size, **a.model_kwargs).to(device)
    cfg = resolve_data_config({"img_size": a.img_size}, model=model)
    ds = create_dataset("", root=data_dir, split="train", is_training=True)
    ds.transform = create_transform(cfg["input_size"], is_training=True, no_aug=True, interpolation="bicubic",
                                    mean=cfg["mean"], std=cfg["std"])
    sampler = torch.utils.data.RandomSampler(ds)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, sampler=sampler, drop_last=True,
                                         num_workers=a.workers, pin_memory=device.type == "cuda")
    opt = create_optimizer_v2(model, opt="sgd", lr=0.01, weight_decay=2e-5, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    dtype = torch.bfloat16 if a.amp_dtype == "bfloat16" else torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=a.amp and dtype == torch.float16)
    rates = []
    model.train()
    for _ in range(a.epochs):
        t0, n = time.perf_counter(), 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=a.amp):
                loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            n += len(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(n / (time.perf_counter() - t0))
    return rates


def trainer_loop(a, data_dir, out_dir, run):
    """images/s of each epoch of ``ttt-zoo train`` (its summary.csv)."""
    from ttt_zoo.train.trainer import main
    kwargs = [f"{k}={v}" for k, v in a.model_kwargs.items()]
    argv = ["--data-dir", data_dir, "--val-split", "", "--model", a.model, "--img-size", str(a.img_size),
            "--num-classes", "10", "-b", str(a.batch_size), "--epochs", str(a.epochs), "--workers", str(a.workers),
            "--opt", "sgd", "--lr", "0.01", "--weight-decay", "2e-5", "--warmup-epochs", "0", "--no-aug",
            "--smoothing", "0", "--train-interpolation", "bicubic", "--seed", str(a.seed), "--output", out_dir, "--experiment", f"run{run}",
            "--amp-dtype", a.amp_dtype]
    if kwargs:
        argv += ["--model-kwargs", *kwargs]
    if a.amp:
        argv.append("--amp")
    if a.device:
        argv += ["--device", a.device]
    if device_is_cuda(a):
        argv.append("--pin-mem")
    main(argv)
    with open(os.path.join(out_dir, f"run{run}", "summary.csv")) as f:
        return [float(r["train_img_per_sec"]) for r in csv.DictReader(f)]


def device_is_cuda(a):
    return (a.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")


def main():
    from timm.utils import ParseKwargs
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vit3_tiny")
    p.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("-b", "--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=4, help="per run; the first is warm-up")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("-j", "--workers", type=int, default=8)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--amp-dtype", default="bfloat16", choices=("float16", "bfloat16"))
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="image folder with train/<class>/ (default: digits, made here)")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "train_overhead.md"))
    a = p.parse_args()
    if a.epochs < 2:
        p.error("--epochs must be at least 2 (the first epoch is warm-up)")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = a.data_dir
        if data_dir is None:
            from ttt_zoo.train.digits import make_digits_folder
            data_dir = os.path.join(tmp, "digits")
            make_digits_folder(data_dir, img_size=a.img_size)
        bare, ours = [], []
        for r in range(a.repeats):
            bare += bare_loop(a, data_dir, device)[1:]
            ours += trainer_loop(a, data_dir, os.path.join(tmp, "runs"), r)[1:]
            print(f"repeat {r}: bare {statistics.median(bare):.1f} img/s, ttt-zoo train "
                  f"{statistics.median(ours):.1f} img/s", flush=True)
    b, o = statistics.median(bare), statistics.median(ours)
    overhead = 100.0 * (b - o) / b
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    text = (f"# `ttt-zoo train` overhead over a bare training loop\n\n"
            f"`{' '.join(['python', 'experiments/bench_train_overhead.py'] + sys.argv[1:])}`\n\n"
            f"Device: {dev} ({device.type}), torch {torch.__version__}. Model `{a.model}` {a.model_kwargs or ''}, "
            f"img {a.img_size}, batch {a.batch_size}, {a.workers} workers, amp {a.amp_dtype if a.amp else 'off'}; "
            f"{a.repeats} repeat(s) x {a.epochs - 1} measured epochs each (median).\n\n"
            f"| loop | images/s (median) | epochs measured |\n|---|---:|---:|\n"
            f"| bare loop | {b:.1f} | {len(bare)} |\n| ttt-zoo train | {o:.1f} | {len(ours)} |\n\n"
            f"Overhead: **{overhead:+.2f}%** (target: at most 5%: {'met' if overhead <= 5 else 'NOT met'}).\n")
    from ttt_zoo.fileio import atomic_write
    atomic_write(a.out, text)
    print(text)


if __name__ == "__main__":
    main()
