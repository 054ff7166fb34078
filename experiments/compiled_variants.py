"""Count the compiled variants of the fused ViT3 kernels (``kernels/vit3_ttt/fused.py``) over the standard shapes,
without a GPU: every launch's key is what Triton's ``JITFunction`` keys its compile cache on, the specialization
the sm_90 binder builds from the arguments (dtype of each pointer, 16-byte alignment and ``== 1`` of each integer
not in ``do_not_specialize``) plus the constexprs and launch options, recorded by
``ttt_zoo.bench.compiled_variants._record`` (as every model's count is).  Launches are recorded, not run (meta
tensors).

    python experiments/compiled_variants.py                    # writes experiments/results/compiled_variants.md
    python experiments/compiled_variants.py --module ttt_zoo.kernels.vit3_ttt._old_fused --out /tmp/before.md

Standard shapes: ViT3-T / ViT3-S / ViT3-B and every stage of H-ViT3-T at 224, 256, 384, 512 and 1024 px, batch 1,
32 and 64, forward and backward, in fp32, fp16 and bf16.
"""
import argparse
import importlib
import os
from collections import defaultdict

os.environ.pop("TRITON_INTERPRET", None)  # noqa: E402  (the JIT's own binder, not the interpreter)

import torch  # noqa: E402

from ttt_zoo.bench.compiled_variants import _record  # noqa: E402  (the recorder every count uses)
from ttt_zoo.fileio import atomic_write  # noqa: E402

SIZES = (224, 256, 384, 512, 1024)
BATCHES = (1, 32, 64)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# model -> [(heads, head dim, stride of the feature map)]: ViT3's patch 16; H-ViT3-T's four stages
MODELS = {"vit3_tiny": [(6, 32, 16)], "vit3_small": [(6, 64, 16)], "vit3_base": [(12, 64, 16)],
          "hvit3_tiny": [(2, 32, 4), (4, 32, 8), (10, 32, 16), (16, 32, 32)]}


def shapes():
    """(model, px, batch, heads, d, H, W) of every fused-op call of the standard shapes."""
    for model, stages in MODELS.items():
        for px in SIZES:
            for batch in BATCHES:
                for heads, d, stride in stages:
                    side = -(-px // stride)
                    yield model, px, batch, heads, d, side, side


def launch(module, b, heads, d, hh, ww, dtype):
    """One forward and one backward of the fused op on meta tensors (nothing allocated, nothing run)."""
    n, c = hh * ww, heads * d
    qkv = torch.empty(b, n, 3 * c + 3 * d, device="meta", dtype=dtype)
    views = [qkv[..., i * c:(i + 1) * c].unflatten(-1, (heads, d)).transpose(1, 2) for i in range(3)] + \
        [qkv[..., 3 * c + i * d:3 * c + (i + 1) * d].transpose(1, 2).unflatten(-1, (hh, ww)) for i in range(3)]
    ws = [torch.empty(1, heads, d, d, device="meta") for _ in range(2)] + [torch.empty(d, 1, 3, 3, device="meta")]
    out, *small = module.qkv_fused_fwd(*views, *ws, 1 / 3, True)
    module.qkv_fused_bwd(torch.empty_like(out), *views, *ws, *small, 1 / 3, True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", default="ttt_zoo.kernels.vit3_ttt.fused")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "compiled_variants.md"))
    ap.add_argument("--before", help="the same count for the kernels before (a module name), as a second column")
    args = ap.parse_args()
    counts = {}
    for name in [args.module] + ([args.before] if args.before else []):
        module = importlib.import_module(name)
        calls = []
        per = defaultdict(set)  # (kernel, dtype, d) -> keys
        launches = 0
        with _record(calls):
            for model, px, b, heads, d, hh, ww in shapes():
                for dtype in DTYPES:
                    calls.clear()
                    launch(module, b, heads, d, hh, ww, dtype)
                    launches += len(calls)
                    for kernel, key in calls:
                        per[(kernel, str(dtype)[6:], d)].add(key)
        counts[name] = (per, launches)
    per, launches = counts[args.module]
    before = counts[args.before][0] if args.before else {}
    n_shapes = len(list(shapes()))
    lines = ["# Compiled variants of the fused ViT3 kernels over the standard shapes", "",
             f"`python experiments/compiled_variants.py{' --before ' + args.before if args.before else ''}` "
             "(no GPU: the key of Triton's compile cache from `JITFunction`'s sm_90 binder, per launch; "
             "`ttt_zoo.bench.compiled_variants._record`).  Shapes: ViT3-T/S/B "
             "and the four stages of H-ViT3-T at 224, 256, 384, 512 and 1024 px, batch 1, 32 and 64 "
             f"({n_shapes} op calls per dtype, forward + backward: {launches} launches in all)."
             + (f"  Before: `{args.before}`, the kernels at 299558e (`git show 299558e:kernels/vit3_ttt/fused.py`"
                " saved as that module for the run): sizes, strides and heads specialised." if args.before else ""),
             "",
             "| kernel | dtype | head dim | variants before | variants after |", "|---|---|---|---|---|"]
    for key in sorted(per):
        b = len(before.get(key, ())) if args.before else "-"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {b} | {len(per[key])} |")
    total_before = sum(len(v) for v in before.values()) if args.before else "-"
    lines += ["", f"Total: {total_before} before, {sum(len(v) for v in per.values())} after "
              f"({len(per)} (kernel, dtype, head dim) combinations)."]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    atomic_write(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
