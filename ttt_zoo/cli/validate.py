"""``ttt-zoo validate``: top-1 / top-5 of a model on an image folder (flags and result columns follow timm's
``validate.py``).

    ttt-zoo validate --data-dir data/digits32 --model vit3_tiny --model-kwargs depth=2 \\
        --checkpoint output/train/run1/best.safetensors --img-size 32 --results-file results.csv
    ttt-zoo validate --data-dir /data/imagenet --model vit3_tiny --pretrained --results-file vit3.json
    ttt-zoo validate --data-dir data/digits32 --model vit3_tiny --checkpoint output/train/run1 --use-ema
    ttt-zoo validate --checkpoint output/train/run1     # a `ttt-zoo train` folder: its args.yaml gives the rest

With a training folder (or a file in one) as ``--checkpoint``, the folder's ``args.yaml`` supplies ``--model``,
``--model-kwargs``, ``--img-size``, ``--num-classes``, ``--crop-pct``, ``--data-dir`` and the split; flags given on
the command line override it.  Its recorded class names (run.json; a Hub folder's ``label_names``) label the class
folders by name: a folder lacking some classes is fine, a folder of a class the run does not know is refused.  A
plain weights file has no names: the folders are matched by position (timm's order), with a note when their
number differs from the model's classes.
"""
__all__ = ["add_parser", "run"]

# the flags a `ttt-zoo train` folder's recorded arguments supply (ttt_zoo.run_folder.RUN_DEFAULTS)
_RUN_FLAGS = ("model", "model_kwargs", "img_size", "num_classes", "crop_pct", "data_dir", "split")


def _is_number(text) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def _class_names(resolved):
    """The checkpoint's class names in output order: the run's recorded ones, or a Hub folder's ``label_names``
    (a list); None when neither names them (a plain weights file: folders are matched by position)."""
    import os
    names = resolved.class_names
    path = resolved.path
    if names is None and path and os.path.isdir(path) and resolved.folder is None:
        from ttt_zoo import hub_format
        if os.path.isfile(os.path.join(path, hub_format.CONFIG_NAME)):
            labels = hub_format.read_config(path).get("label_names")
            names = list(labels) if isinstance(labels, list) else None
    return names


def _apply_run_args(args):
    """Fill the flags not given on the command line from the run's recorded arguments (the one --checkpoint
    resolver, :func:`ttt_zoo.run_folder.resolve_checkpoint`); another --model shares only the data. Returns the
    checkpoint's class names (see :func:`_class_names`)."""
    from ttt_zoo.run_folder import apply_run_defaults, resolve_checkpoint
    from ._common import UsageError
    resolved = resolve_checkpoint(args.checkpoint, ema=True if args.use_ema else None,
                                  other_folders=True)  # (a folder of weight files: validate reads each one)
    apply_run_defaults(args, resolved, _RUN_FLAGS, always=("data_dir", "split"))
    if _is_number(args.split):
        raise UsageError(f"the run held out --val-split {args.split} of its training images, which validate does "
                         f"not rebuild; give --split (e.g. val) with a folder of held-out images")
    args.split = args.split or "validation"
    if not args.model:
        raise UsageError("no model given; give --model NAME, or --checkpoint with a `ttt-zoo train` folder (its args.yaml "
                         "names the model)")
    if not args.data_dir:
        raise UsageError("no data given; give --data-dir DIR (an image folder with a val/ split)")
    return _class_names(resolved)


def run(args) -> int:
    from ttt_zoo.train.validate import _results_format, validate, write_results
    from ttt_zoo.registry import resolve_model_name
    from ._common import check_out
    from ttt_zoo.torchcompile import check_torchcompile
    check_torchcompile(args.torchcompile, args.torchcompile_mode)
    class_names = _apply_run_args(args)
    resolve_model_name(args.model, "image", "--model")
    if args.results_file:
        _results_format(args.results_file)  # a bad extension fails before the evaluation, not after it
        check_out(args.results_file, args.force, "--results-file")
    rows = validate(args.model, args.data_dir, checkpoint=args.checkpoint, pretrained=args.pretrained,
                    use_ema=args.use_ema, batch_size=args.batch_size, img_size=args.img_size,
                    crop_pct=args.crop_pct, amp=args.amp, num_classes=args.num_classes, split=args.split,
                    workers=args.workers, device=args.device, model_kwargs=args.model_kwargs,
                    torchcompile=args.torchcompile, torchcompile_mode=args.torchcompile_mode,
                    class_names=class_names)
    for r in rows:
        print(f"{r['model']} {r['checkpoint']}: top1 {r['top1']:.3f} top5 {r['top5']:.3f} "
              f"({r['param_count']:.2f}M params, {r['img_size']}px, crop_pct {r['crop_pct']})")
    if args.results_file:
        write_results(rows, args.results_file)
        print(f"results written to {args.results_file}")
    return 0


def add_parser(sub) -> None:
    from ttt_zoo import flags
    from ttt_zoo.flags import MAX_IMG_SIDE, ModelKwargs, Range
    from ttt_zoo.torchcompile import add_torchcompile_args
    p = sub.add_parser("validate", help="top-1/top-5 of a model (a checkpoint, a folder of them, or pretrained)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="image folder with a val/ (or validation/) split (default: a training folder's)")
    p.add_argument("--split", default=None,
                   help="subfolder to evaluate ('validation' also finds 'val'; default: a training folder's, "
                        "else validation)")
    p.add_argument("--model", default=None,
                   help="model name (timm registry, ttt-zoo models included; default: a training folder's)")
    p.add_argument("--model-kwargs", nargs="*", default={}, action=ModelKwargs, metavar="K=V",
                   help="extra model constructor arguments, as given to ttt-zoo train")
    p.add_argument("--checkpoint", default="", metavar="PATH",
                   help="weights file (.safetensors, .pth, .pt) or a folder: validate every checkpoint in it")
    p.add_argument("--pretrained", action="store_true", help="the model's pretrained weights (without --checkpoint)")
    p.add_argument("--use-ema", action="store_true", help="the EMA weights (<tag>_ema.safetensors, or the EMA entry)")
    p.add_argument("-b", "--batch-size", type=Range(int, ge=1, le=65536), default=64)
    p.add_argument("--img-size", type=Range(int, ge=1, le=MAX_IMG_SIDE), default=None,
                   help="input size (default: the model's)")
    p.add_argument("--crop-pct", type=flags.CROP_PCT, default=None,
                   help="center crop fraction (default: the model's)")
    p.add_argument("--amp", action="store_true", help="autocast (bfloat16 on CPU, float16 on CUDA)")
    p.add_argument("--num-classes", type=Range(int, ge=1, le=1_000_000), default=None,
                   help="default: the number of class folders with --checkpoint, else the model's")
    p.add_argument("-j", "--workers", type=Range(int, ge=0, le=256), default=2)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    add_torchcompile_args(p)
    p.add_argument("--results-file", default="", metavar="FILE", help="write the rows as .csv or .json")
    p.add_argument("--force", action="store_true", help="replace an existing --results-file")
    p.set_defaults(func=run)
