"""Evidence on real offline data that linearization works: scikit-learn's digits, upsampled to 32x32.

1. train a small softmax ViT (timm VisionTransformer, patch 8 -> 4x4 tokens, no class token, mean pooling as in
   the paper);
2. ``ttt_zoo.linearize`` it into T5 (and T5+ with 3x3 neighbourhood attention) and evaluate right away;
3. fine-tune briefly (new TTT parameters at 20x the base learning rate, ``ttt_zoo.param_groups``), evaluate again;
4. the same with plain linear attention (elu+1 feature map, no new parameters), the paper's comparison;
5. control: T5 trained from scratch for the same number of fine-tuning epochs.
Writes experiments/results/linearize_digits.{md,json}.  Needs scikit-learn (`pip install scikit-learn`).

    python experiments/linearize_digits.py [--epochs 25 --ft-epochs 6 --threads 1]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

import timm.optim
import ttt_zoo
from timm.models.vision_transformer import VisionTransformer


def load_digits_32(seed: int):
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise SystemExit("This script needs scikit-learn: pip install scikit-learn") from e
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target)
    tr, te = train_test_split(range(len(y)), test_size=0.25, random_state=seed, stratify=d.target)
    return x[tr], y[tr], x[te], y[te]


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random shifts of up to 2 pixels (zero padding)."""
    pad = F.pad(x, (2, 2, 2, 2), value=float(x.min()))
    dy, dx = torch.randint(0, 5, (2,), generator=gen).tolist()
    return pad[..., dy:dy + 32, dx:dx + 32]


class LinearAttention(nn.Module):
    """Plain linear attention (Katharopoulos et al.: phi = elu + 1) reusing a timm Attention's qkv / proj."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.num_heads = attn.num_heads
        self.qkv = attn.qkv
        self.proj = attn.proj

    def forward(self, x, attn_mask=None, is_causal=False):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k = F.elu(q) + 1.0, F.elu(k) + 1.0
        kv = k.transpose(-2, -1) @ v
        z = q @ k.sum(dim=-2, keepdim=True).transpose(-2, -1)
        out = (q @ kv) / (z + 1e-6)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def to_linear_attention(model: VisionTransformer) -> VisionTransformer:
    model = copy.deepcopy(model)
    for blk in model.blocks:
        blk.attn = LinearAttention(blk.attn)
    return model


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int = 256) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(y), bs):
        logits = model(x[i:i + bs])
        if not torch.isfinite(logits).all():
            return float("nan")
        correct += (logits.argmax(-1) == y[i:i + bs]).sum().item()
    return 100.0 * correct / len(y)


AUGMENT = True


def train(model, groups, x, y, epochs: int, seed: int, bs: int = 64, warmup: int = 1):
    opt = torch.optim.AdamW(groups)
    base = [g["lr"] for g in opt.param_groups]
    steps_per_epoch = math.ceil(len(y) / bs)
    total = epochs * steps_per_epoch
    gen = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), bs):
            idx = perm[i:i + bs]
            w = min(1.0, (step + 1) / (warmup * steps_per_epoch))  # linear warmup, then cosine
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr * w * 0.5 * (1 + math.cos(math.pi * step / total))
            xb = augment(x[idx], gen) if AUGMENT else x[idx]
            loss = F.cross_entropy(model(xb), y[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            step += 1
    return model


def n_params(names, model):
    named = dict(model.named_parameters())
    return sum(named[n].numel() for n in names)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=25, help="softmax ViT training epochs")
    ap.add_argument("--ft-epochs", type=int, default=6, help="fine-tuning epochs after conversion")
    ap.add_argument("--lr", type=float, default=3e-3, help="softmax training lr")
    ap.add_argument("--ft-lr", type=float, default=3e-4, help="fine-tuning base lr (new TTT params x20)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--patch", type=int, default=8, help="patch size on the 32x32 images")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--no-aug", action="store_true", help="no random shifts")
    ap.add_argument("--quick", action="store_true", help="only train and evaluate the softmax ViT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "linearize_digits"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global AUGMENT
    AUGMENT = not args.no_aug
    torch.manual_seed(args.seed)
    t0 = time.time()
    xtr, ytr, xte, yte = load_digits_32(args.seed)
    cfg = dict(img_size=32, patch_size=args.patch, in_chans=1, num_classes=10, embed_dim=args.dim, depth=args.depth, num_heads=2,
               mlp_ratio=2.0, class_token=False, global_pool="avg", fc_norm=False)
    wd = 0.05

    softmax = VisionTransformer(**cfg)
    train(softmax, [dict(g, lr=args.lr) for g in timm.optim.param_groups_weight_decay(softmax, wd)],
          xtr, ytr, args.epochs, args.seed, bs=args.batch)
    acc_softmax = accuracy(softmax, xte, yte)
    print(f"softmax ViT: {acc_softmax:.2f}%  ({time.time() - t0:.0f}s)", flush=True)

    if args.quick:
        return
    rows = [dict(model="softmax ViT (source)", new_params=0, converted=acc_softmax, finetuned=None)]

    def finetune(model, new_names, multiplier):
        groups = ttt_zoo.param_groups(model, new_names, lr=args.ft_lr, multiplier=multiplier, weight_decay=wd)
        groups = [dict(g, lr=g["lr"] * g["lr_scale"]) for g in groups]  # this loop's own schedule: absolute lrs
        return train(model, groups, xtr, ytr, args.ft_epochs, args.seed + 1, bs=args.batch)

    for label, kw in (("T5 (linearized)", {}), ("T5+ (linearized, NA 3x3)", dict(na_kernel=3))):
        model, new = ttt_zoo.linearize(softmax, **kw)
        before = accuracy(model, xte, yte)
        after = accuracy(finetune(model, new, 20.0), xte, yte)
        rows.append(dict(model=label, new_params=n_params(new, model), converted=before, finetuned=after))
        print(f"{label}: {before:.2f}% -> {after:.2f}%  ({time.time() - t0:.0f}s)", flush=True)

    lin = to_linear_attention(softmax)
    before = accuracy(lin, xte, yte)
    after = accuracy(finetune(lin, [], 1.0), xte, yte)
    rows.append(dict(model="linear attention (elu+1, inherited)", new_params=0, converted=before, finetuned=after))
    print(f"linear attention: {before:.2f}% -> {after:.2f}%  ({time.time() - t0:.0f}s)", flush=True)

    scratch = ttt_zoo.models.T5(img_size=32, patch_size=args.patch, in_chans=1, num_classes=10, embed_dim=args.dim,
                                depth=args.depth, num_heads=2, mlp_ratio=2.0)
    acc0 = accuracy(scratch, xte, yte)
    after = accuracy(train(scratch, [dict(g, lr=args.lr) for g in timm.optim.param_groups_weight_decay(scratch, wd)],
                           xtr, ytr, args.ft_epochs, args.seed + 1, bs=args.batch), xte, yte)
    rows.append(dict(model="T5 from scratch (control, same epochs)", new_params=None, converted=acc0, finetuned=after))
    print(f"T5 scratch: {acc0:.2f}% -> {after:.2f}%  ({time.time() - t0:.0f}s)", flush=True)

    elapsed = time.time() - t0
    setup = (f"sklearn digits (1797 images, 8x8 -> 32x32 bilinear, 1 channel), stratified split "
             f"{len(ytr)} train / {len(yte)} test (seed {args.seed}); ViT: patch {args.patch} ({32 // args.patch}x{32 // args.patch} tokens), dim {args.dim}, depth {args.depth}, "
             f"2 heads, mlp_ratio 2, no class token, mean pooling; softmax ViT trained {args.epochs} epochs "
             f"(AdamW lr {args.lr}, wd {wd}, batch {args.batch}, cosine, label smoothing 0.1, +-2px shifts); "
             f"fine-tuning {args.ft_epochs} epochs at base lr {args.ft_lr}, new TTT params x20 "
             f"(ttt_zoo.param_groups). Control: T5 from random init, {args.ft_epochs} epochs at lr {args.lr}. "
             f"CPU, {args.threads} threads, torch {torch.__version__}, {elapsed:.0f}s total.")
    result = dict(setup=setup, args=vars(args), rows=rows, seconds=elapsed, platform=platform.platform())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"
    lines = ["# Linearizing a softmax ViT on sklearn digits", "", setup, "",
             "| model | new params | test acc. right after conversion (%) | after fine-tuning (%) |",
             "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {'-' if r['new_params'] is None else r['new_params']} | "
                     f"{fmt(r['converted'])} | {fmt(r['finetuned'])} |")
    lines += ["", "Generated by `experiments/linearize_digits.py`."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
