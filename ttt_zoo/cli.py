"""The ``ttt-zoo`` command (also ``python -m ttt_zoo``)."""

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["main", "model_stats", "classify_image"]

ASSET_IMAGE = os.path.join(os.path.dirname(__file__), "assets", "chelsea.jpg")


def model_stats(name: str, img_size: int = 224) -> Dict[str, float]:
    """Parameters and GFLOPs (multiply-accumulates, as the papers count them) on the meta device.

    Image models are measured at ``img_size``; diffusion models (``forward(x, t, y)``) at their configured latent size.
    """
    import timm
    from torch.utils.flop_counter import FlopCounterMode
    from .hub import example_inputs
    with torch.device("meta"):
        model = timm.create_model(name)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    inputs = example_inputs(model, 1, device="meta")
    if len(inputs) == 1:
        inputs = (torch.empty(1, getattr(model, "in_chans", 3), img_size, img_size, device="meta"),)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    return dict(params=params, gflops=counter.get_total_flops() / 2 / 1e9, input=list(inputs[0].shape[1:]))


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


def _cmd_list(args) -> int:
    from . import list_zoo_models
    names = [n for n in list_zoo_models(include_diffusion=True) if not args.filter or args.filter in n]
    print(f"{'model':<22}{'params (M)':>12}{'GFLOPs':>10}  input")
    for n in names:
        try:
            s = model_stats(n, args.img_size)
            print(f"{n:<22}{s['params'] / 1e6:>12.3f}{s['gflops']:>10.2f}  {'x'.join(map(str, s['input']))}")
        except Exception as e:  # noqa: BLE001 - report and continue
            print(f"{n:<22}  (could not be measured: {type(e).__name__}: {e})")
    return 0


def _cmd_demo(args) -> int:
    from . import list_zoo_models
    from .benchmark import format_table, scaling_table
    print("== ttt-zoo: registered models ==")
    _cmd_list(argparse.Namespace(filter="", img_size=224))
    print(f"\n== Classifying a real photograph ({os.path.basename(ASSET_IMAGE)}, CC0) ==")
    print("NOTE: weights are randomly initialised (no download here), so these labels are NOT meaningful;\n"
          "      pass --pretrained on a machine that can reach the authors' checkpoints for real predictions.")
    families = [n for n in ("vit3_tiny", "hvit3_tiny", "visionttt_tiny", "t5_tiny") if n in list_zoo_models()]
    for name in families:
        top = classify_image(name, pretrained=args.pretrained)
        print(f"{name:<16} " + ", ".join(f"{lab} ({p:.3f})" for lab, p in top))
    if not args.skip_bench:
        print("\n== CPU scaling, batch 1, inference: vit3_tiny vs timm deit_tiny_patch16_224 (side by side) ==")
        rows = scaling_table(["vit3_tiny", "deit_tiny_patch16_224"], args.sizes, iters=args.iters)
        print(format_table(rows))
        print("latency: median ms per forward; memory: peak RSS growth during the forward (MB).")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ttt-zoo", description="Test-Time-Training vision backbones for timm.")
    sub = p.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("list", help="list registered models with parameters and GFLOPs")
    lp.add_argument("--filter", default="", help="substring of model names")
    lp.add_argument("--img-size", type=int, default=224)
    lp.set_defaults(func=_cmd_list)
    dp = sub.add_parser("demo", help="list models, classify a bundled photo, CPU scaling table vs DeiT-T")
    dp.add_argument("--pretrained", action="store_true", help="use released weights (needs network)")
    dp.add_argument("--sizes", type=int, nargs="+", default=[224, 512, 1024])
    dp.add_argument("--iters", type=int, default=3)
    dp.add_argument("--skip-bench", action="store_true")
    dp.set_defaults(func=_cmd_demo)
    from . import hub
    hub.add_convert_parser(sub)
    hub.add_push_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
