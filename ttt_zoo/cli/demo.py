"""``ttt-zoo demo``: list the models, classify a bundled photograph, CPU scaling table against DeiT-T."""

import argparse
import os

import torch

from .list import run as list_run

__all__ = ["add_parser", "classify_image", "ASSET_IMAGE"]

ASSET_IMAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "chelsea.jpg")


def classify_image(name: str, path: str = ASSET_IMAGE, topk: int = 3, pretrained: bool = False):
    """Top-k ImageNet labels for one image with the model's own preprocessing."""
    import timm
    from PIL import Image
    from timm.data import ImageNetInfo, create_transform, resolve_data_config
    model = timm.create_model(name, pretrained=pretrained).eval()
    cfg = resolve_data_config({}, model=model)
    x = create_transform(**cfg)(Image.open(path).convert("RGB")).unsqueeze(0)
    with torch.no_grad():
        probs = model(x).softmax(-1)[0]
    info = ImageNetInfo()
    top = probs.topk(topk)
    return [(info.index_to_description(int(i)), float(p)) for p, i in zip(top.values, top.indices)]


def run(args) -> int:
    from ttt_zoo import list_zoo_families
    from ttt_zoo.bench import format_table, scaling_table
    print("== ttt-zoo: registered models ==")
    list_run(argparse.Namespace(filter="", img_size=224))
    print(f"\n== Classifying a real photograph ({os.path.basename(ASSET_IMAGE)}, CC0) ==")
    print("NOTE: weights are randomly initialised (no download here), so these labels are NOT meaningful;\n"
          "      pass --pretrained on a machine that can reach the authors' checkpoints for real predictions.")
    families = list_zoo_families()  # the smallest model of every image family, from the registry
    for name in families.values():
        top = classify_image(name, pretrained=args.pretrained)
        print(f"{name:<16} " + ", ".join(f"{lab} ({p:.3f})" for lab, p in top))
    if not args.skip_bench:
        vit3 = families["vit3"]
        print(f"\n== CPU scaling, batch 1, inference: {vit3} vs timm deit_tiny_patch16_224 (side by side) ==")
        rows = scaling_table([vit3, "deit_tiny_patch16_224"], args.sizes, iters=args.iters)
        print(format_table(rows))
        print("latency: median ms per forward; memory: peak RSS growth during the forward (MB).")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="list models, classify a bundled photo, CPU scaling table vs DeiT-T")
    p.add_argument("--pretrained", action="store_true", help="use released weights (needs network)")
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 512, 1024])
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--skip-bench", action="store_true")
    p.set_defaults(func=run)
