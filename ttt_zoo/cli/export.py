"""``ttt-zoo export``: a classifier to ONNX (torch's dynamo exporter; dynamic batch and image size).

    ttt-zoo export --format onnx --model vit3_tiny --out vit3_tiny.onnx
    ttt-zoo export --format onnx --model hvit3_tiny --checkpoint hvit3_tiny.pth --img-size 256 256 --out h.onnx
"""

import argparse
import sys

from ttt_zoo.errors import CheckpointError

from ._common import add_model_kwargs, check_out, model_kwargs

__all__ = ["add_parser", "run"]


def run(args) -> int:
    from ttt_zoo.registry import create_model, resolve_model_name
    from ttt_zoo.export import ExportError, export_onnx
    try:
        from ttt_zoo.run_folder import resolve_checkpoint, run_model_kwargs
        resolved = resolve_checkpoint(args.checkpoint)  # a run folder or a file in one: checked against the run
        args.model = args.model or resolved.model  # a run builds its own model from its record
        if not args.model:
            raise ValueError("no model given; give --model NAME, or --checkpoint with a `ttt-zoo train` run folder "
                             "(its run.json names the model)")
        resolve_model_name(args.model, "image", "--model")
        check_out(args.out, True)  # the folder must be writable; an existing --out is refused before the export
        given = model_kwargs(args)
        if args.num_classes is not None:
            given["num_classes"] = args.num_classes
        kwargs = run_model_kwargs(resolved, args.model, given)
        img_size = args.img_size or resolved.img_size(args.model)  # default: the size the run trained at
        if resolved.weights:  # read safely by ttt_zoo.checkpoint, then the model file's checkpoint_filter_fn
            kwargs["pretrained_cfg_overlay"] = dict(file=resolved.weights)
        model = create_model(args.model, pretrained=bool(args.checkpoint), **kwargs)
        mult, min_side = export_onnx(model, args.out, img_size, overwrite=args.force)
    except (CheckpointError, ExportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: input 'image' (batch, {getattr(model, 'in_chans', 3)}, height, width), any batch, "
          f"height and width multiples of {mult} from {min_side}; output 'output'")
    return 0


def add_parser(sub) -> None:
    from ttt_zoo.flags import MAX_EXPORT_SIDE, Range
    p = sub.add_parser("export", help="export a classifier to ONNX (dynamic batch and image size)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", choices=("onnx",), default="onnx", help="output format (default: onnx)")
    p.add_argument("--model", default=None,
                   help="registered model name (`ttt-zoo list`; default: the run's, with a run folder as --checkpoint)")
    p.add_argument("--num-classes", type=Range(int, ge=0, le=1_000_000), default=None,
                   help="classifier outputs (default: the run's, else the model's; 0: features)")
    p.add_argument("--checkpoint", help="weights to load (.pth / .safetensors; official or ours) or a `ttt-zoo "
                   "train` run folder; default: the model's initialisation")
    p.add_argument("--img-size", nargs=2, type=Range(int, ge=1, le=MAX_EXPORT_SIDE), metavar=("H", "W"),
                   help="example size the graph is traced at (default: the run's, else the model's); the graph "
                        "takes others too")
    add_model_kwargs(p)
    p.add_argument("--out", required=True, help="the .onnx file (written only once the export is complete)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.set_defaults(func=run)
