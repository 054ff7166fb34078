"""Numerics of every registered family, on realistic inputs (the bundled photograph, or latents made from it).

Per model and input size, all relative (``max|a - b| / max|b|``) on the model's output:

- fp32 vs fp64: fp32 through the default backend against float64 through ``backend='torch_naive'`` (the plain,
  independent reference: the per-mini-batch scan ``ttt_linear_naive`` for Vision-TTT, the plain autograd references
  for the other ops);
- batch invariance: one sample alone vs the same sample inside a batch of 2;
- grad vs no-grad: the forward with autograd recording (the training paths) vs inference;
- bf16 vs fp32: CPU bf16 autocast vs fp32, first sample (``non-finite`` flags a non-finite bf16 output).

``tests/test_numerics.py`` runs the same measurements with bounds; this tool prints the table for every family and
writes it to ``experiments/results/numerics.md`` (atomically)::

    PYTHONPATH=$PWD python experiments/numerics_table.py [--out experiments/results/numerics.md] \
        [--models vit3_tiny ...]
"""
import argparse
import copy
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from torch import nn

from ttt_zoo.kernels.backend import use_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHOTO = os.path.join(ROOT, "ttt_zoo", "assets", "chelsea.jpg")
METRICS = ("fp64", "batch", "grad", "bf16")
DIFFUSION_PREFIXES = ("dit_", "dit3_", "dit5_")
# (model, input size, model kwargs, note): per family, the tiny model at full depth on a square input, one
# non-square input with a stage of N >= 3000 tokens, and one larger model.  Each case covers a distinct path once:
# hierarchical models at 224 already run their stage 0 at 56 x 56 = 3136 tokens, so their larger model takes the
# non-square size (256 x 224: 64 x 56 = 3584); plain models reach N = 3072 at 1024 x 768 px, run with their first
# 2 blocks (the length, not the depth, is what grows the scan's error).  DiT latents: 32 x 32, and 128 x 96 (N = 3072
# at patch 2) with 2 blocks for the linear-time mixers.
Case = Tuple[str, Tuple[int, int], Dict, str]


def _plain(family: str) -> List[Case]:
    return [(f"{family}_tiny", (224, 224), {}, ""), (f"{family}_tiny", (1024, 768), {"depth": 2}, "2 blocks, N=3072"),
            (f"{family}_small", (224, 224), {}, "")]


def _hierarchical(family: str) -> List[Case]:
    return [(f"{family}_tiny", (224, 224), {}, "stage 0 N=3136"),
            (f"{family}_small", (256, 224), {}, "stage 0 N=3584")]


def _latent(family: str) -> List[Case]:
    return [(f"{family}_s_2", (32, 32), {}, "latent"),
            (f"{family}_s_2", (128, 96), {"depth": 2}, "latent, 2 blocks, N=3072"),
            (f"{family}_b_2", (32, 32), {}, "latent")]


CASES: List[Case] = (
    _plain("vit3") + _hierarchical("hvit3") + _plain("t5") + _plain("t5_plus") + _plain("visionttt")
    + _hierarchical("visionttt_h") + _latent("dit3") + _latent("dit5")
    + [("dit_s_2", (32, 32), {}, "latent, softmax"), ("dit_s_2", (32, 24), {}, "latent, softmax")])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| in float64; inf when a is not finite."""
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).abs().max() / b.abs().max()).item()


def _photo_rgb(h: int, w: int) -> torch.Tensor:
    img = Image.open(PHOTO).convert("RGB").resize((w, h), Image.BICUBIC)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255.0


def photo(h: int, w: int) -> torch.Tensor:
    """(2, 3, h, w): the photograph, ImageNet-normalised, and its mirror image."""
    x = _photo_rgb(h, w)
    mean = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    x = (x - mean) / std
    return torch.stack([x, x.flip(-1)])


def latent(h: int, w: int) -> torch.Tensor:
    """(2, 4, h, w) smooth latent-like input: the photograph's R, G, B and luminance at the latent size,
    standardised per channel (unit variance, like SD-VAE latents after their 0.18215 scaling), and its mirror."""
    x = _photo_rgb(h, w)
    x = torch.cat([x, x.mean(0, keepdim=True)], 0)
    x = (x - x.mean((1, 2), keepdim=True)) / x.std((1, 2), keepdim=True)
    return torch.stack([x, x.flip(-1)])


def is_diffusion(name: str) -> bool:
    return name.startswith(DIFFUSION_PREFIXES)


def build(name: str, **kwargs) -> nn.Module:
    """Seed-0 model in eval mode.  DiT's adaLN-Zero init makes a fresh model output 0: its zero-initialised
    matrices (adaLN modulations, final linear) are drawn from N(0, 0.02) instead, so every block contributes."""
    import timm
    import ttt_zoo  # noqa: F401  (registers the models)
    torch.manual_seed(0)
    m = timm.create_model(name, **kwargs).eval()
    if is_diffusion(name):
        with torch.no_grad():
            for p in m.parameters():
                if p.requires_grad and p.dim() >= 2 and not p.any():
                    nn.init.normal_(p, std=0.02)
    return m


def inputs(name: str, size: Tuple[int, int], dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, ...]:
    """Forward arguments of a batch of 2: images, or (latents, timesteps, labels) for the diffusion models."""
    h, w = size
    if is_diffusion(name):
        return latent(h, w).to(dtype), torch.tensor([500.0, 250.0], dtype=dtype), torch.tensor([207, 281])
    return (photo(h, w).to(dtype),)


def _take(args: Sequence[torch.Tensor], sl: slice) -> Tuple[torch.Tensor, ...]:
    return tuple(a[sl] for a in args)


def fp64_reference(model: nn.Module, args: Sequence[torch.Tensor]) -> torch.Tensor:
    """The model in float64 through the plain ``torch_naive`` references (the model itself is left in fp32)."""
    m64 = copy.deepcopy(model).double()
    args64 = tuple(a.double() if a.is_floating_point() else a for a in args)
    with torch.no_grad(), use_backend("torch_naive"):
        return m64(*args64)


def measure(model: nn.Module, args: Sequence[torch.Tensor], metrics: Sequence[str] = METRICS) -> Dict[str, float]:
    """The relative deviations of ``metrics`` (see the module docstring) for a batch ``args`` of 2 samples."""
    out: Dict[str, float] = {}
    with use_backend("auto"):
        with torch.no_grad():
            y = model(*args)
        if "fp64" in metrics:
            out["fp64"] = rel(y, fp64_reference(model, args))
        if "batch" in metrics:
            with torch.no_grad():
                out["batch"] = rel(model(*_take(args, slice(1, 2))), y[1:2])
        if "grad" in metrics:
            with torch.enable_grad():
                out["grad"] = rel(model(*args), y)
        if "bf16" in metrics:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # first sample: CPU bf16 is slow
                out["bf16"] = rel(model(*_take(args, slice(0, 1))).float(), y[:1])
    return out


def _fmt(v: Optional[float]) -> str:
    return "" if v is None else ("**non-finite**" if math.isinf(v) else f"{v:.1e}")


def table(rows: List[Tuple[str, str, str, Dict[str, float]]]) -> str:
    lines = ["| model | size | note | fp32 vs fp64 | batch invariance | grad vs no-grad | bf16 vs fp32 |",
             "|---|---|---|---|---|---|---|"]
    for name, size, note, r in rows:
        lines.append(f"| {name} | {size} | {note} | " + " | ".join(_fmt(r.get(k)) for k in METRICS) + " |")
    return "\n".join(lines)


def write_atomic(path: str, text: str) -> None:
    from ttt_zoo.fileio import atomic_write
    atomic_write(path, text)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "numerics.md"))
    ap.add_argument("--models", nargs="*", help="only these models (default: every case)")
    a = ap.parse_args(argv)
    cases = [c for c in CASES if not a.models or c[0] in a.models]
    if not cases:
        sys.exit(f"no case for --models {a.models}; known: {sorted({c[0] for c in CASES})}")
    rows = []
    t0 = time.time()
    for name, size, kwargs, note in cases:
        t = time.time()
        model = build(name, **kwargs)
        r = measure(model, inputs(name, size))
        label = f"{size[0]}x{size[1]}"
        rows.append((name, label, note, r))
        print(f"{name:18s} {label:9s} " + "  ".join(f"{k} {_fmt(v):>8s}" for k, v in r.items())
              + f"  ({time.time() - t:.0f}s)", flush=True)
    text = (f"# Numerics of every family (CPU, torch {torch.__version__}, seed-0 init, photo / photo-latent "
            f"inputs, batch 2)\n\nWritten by `experiments/numerics_table.py` ({time.time() - t0:.0f} s). "
            "Relative deviation max|a - b| / max|b| of the output; fp64 = float64 through `backend='torch_naive'` "
            "(plain per-mini-batch scan for Vision-TTT).\n\n" + table(rows) + "\n")
    write_atomic(a.out, text)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
