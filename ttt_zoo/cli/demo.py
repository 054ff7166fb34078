"""``ttt-zoo demo``: train a small ViT3 on real data (sklearn's digits) with ``ttt-zoo train``, then validate it.

Nothing is downloaded: the digits ship with scikit-learn. The run folder (checkpoints, summary.csv, plot) stays in
``--output``; ``--bench`` adds the CPU scaling table against DeiT-T.
"""

import os
import time

__all__ = ["add_parser", "classify_image", "ASSET_IMAGE"]

ASSET_IMAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "chelsea.jpg")


def classify_image(name: str, path: str = ASSET_IMAGE, topk: int = 3, pretrained: bool = False):
    """Top-k ImageNet labels for one image with the model's own preprocessing."""
    import timm
    import torch
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
    from datetime import datetime

    from ttt_zoo.train.digits import SMALL_MODELS, make_digits_folder
    from ttt_zoo.train.recipes import load_recipe
    from ttt_zoo.train.trainer import main as train_main
    from ttt_zoo.train.validate import validate
    from ttt_zoo.registry import list_zoo_families, list_zoo_models
    families = list_zoo_families(include_diffusion=True)
    print(f"== ttt-zoo: {len(list_zoo_models(include_diffusion=True))} models in {len(families)} families, registered "
          f"with timm (`ttt-zoo list` shows them all with sizes and GFLOPs) ==\n   smallest of each: "
          + ", ".join(families.values()))
    from ttt_zoo.run_folder import refuse_run_output
    refuse_run_output(args.output, "--output")  # only `train` writes into a run folder
    out = os.path.abspath(args.output)
    data = make_digits_folder(os.path.join(out, "digits"), img_size=32)
    recipe, desc = SMALL_MODELS[args.model]
    cfg = load_recipe(recipe)
    experiment = f"{args.model}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    print(f"\n== Training {desc} on sklearn's handwritten digits (32x32, 1,437 train / 360 held-out images) ==\n"
          f"   ttt-zoo train -c {recipe} --data-dir {data} --epochs {args.epochs} --seed {args.seed} --output {out} "
          f"--experiment {experiment}   (settings: ttt_zoo/train/recipes/{recipe}.yaml)\n", flush=True)
    t0 = time.perf_counter()
    train_main(["-c", recipe, "--data-dir", data, "--epochs", str(args.epochs), "--output", out,
                "--experiment", experiment, "--seed", str(args.seed)])
    minutes = (time.perf_counter() - t0) / 60
    folder = os.path.join(out, experiment)
    kwargs = cfg["model_kwargs"]
    from ttt_zoo import run_folder
    rows = validate(cfg["model"], data, checkpoint=run_folder.weights_path(folder, "best"), img_size=32,
                    num_classes=10, workers=0, model_kwargs=kwargs)
    r = rows[0]
    print(f"\n== Result (ttt-zoo validate on the held-out digits; trained in {minutes:.1f} min on this CPU) ==\n"
          f"   {desc}: top-1 {r['top1']:.2f} %, top-5 {r['top5']:.2f} % (chance: 10 %), "
          f"{r['param_count']} M parameters\n   run folder: {folder} (summary.csv, train_plot.png, checkpoints)")
    if args.bench:
        from ttt_zoo.registry import list_zoo_families
        from ttt_zoo.bench import format_table, scaling_table
        vit3 = list_zoo_families()["vit3"]
        print(f"\n== CPU scaling, batch 1, inference: {vit3} vs timm deit_tiny_patch16_224 (side by side) ==")
        print(format_table(scaling_table([vit3, "deit_tiny_patch16_224"], args.sizes, iters=args.iters)))
        print("latency: median ms per forward; memory: peak RSS growth during the forward (MB).")
    return 0


def add_parser(sub) -> None:
    from ttt_zoo.flags import MAX_IMG_SIDE, MAX_SEED, Range
    from ttt_zoo.train.digits import SMALL_MODELS
    p = sub.add_parser("demo", help="train a small TTT model on real digits in about two minutes, then validate it")
    p.add_argument("--model", default="vit3", choices=sorted(SMALL_MODELS), help="which small model to train")
    p.add_argument("--epochs", type=Range(int, ge=1, le=1000), default=10)
    p.add_argument("--seed", type=Range(int, ge=0, le=MAX_SEED), default=0)
    p.add_argument("--output", default="output/demo", help="folder for the digits and the run (kept)")
    p.add_argument("--bench", action="store_true", help="also the CPU scaling table against DeiT-T")
    p.add_argument("--sizes", type=Range(int, ge=1, le=MAX_IMG_SIDE), nargs="+", default=[224, 512, 1024])
    p.add_argument("--iters", type=Range(int, ge=1, le=1000), default=3)
    p.set_defaults(func=run)
