"""``ttt-zoo data``: write small offline data sets for training demos and tests.

    ttt-zoo data digits --out data/digits32 [--img-size 32] [--val-fraction 0.2] [--seed 0]
"""

__all__ = ["add_parser"]


def _run_digits(args) -> int:
    from ttt_zoo.train.digits import make_digits_folder
    from ._common import check_out_folder
    check_out_folder(args.out, [], True, "--out", create=False)  # not in a run folder; its parent writable
    try:
        root = make_digits_folder(args.out, img_size=args.img_size, val_fraction=args.val_fraction, seed=args.seed)
    except (FileExistsError, ValueError, ImportError) as e:
        raise SystemExit(f"ttt-zoo data digits: {e}")
    print(f"digits ImageFolder at {root} (train/ and val/, classes 0..9); train with: "
          f"ttt-zoo train --data-dir {root} --num-classes 10 --img-size {args.img_size} ...")
    return 0


def add_parser(sub) -> None:
    from ttt_zoo.flags import MAX_IMG_SIDE, MAX_SEED, Range
    p = sub.add_parser("data", help="write small offline data sets (image folders) for demos and tests")
    kinds = p.add_subparsers(dest="dataset", required=True)
    d = kinds.add_parser("digits", help="scikit-learn's bundled 8x8 digits as an RGB ImageFolder (train/ and val/)")
    d.add_argument("--out", required=True, help="folder to create (reused if it already holds the same digits folder)")
    d.add_argument("--img-size", type=Range(int, ge=1, le=MAX_IMG_SIDE), default=32,
                   help="side of the upsampled images (bicubic)")
    d.add_argument("--val-fraction", type=Range(float, gt=0, lt=1), default=0.2,
                   help="fraction of each class held out in val/")
    d.add_argument("--seed", type=Range(int, ge=0, le=MAX_SEED), default=0, help="random_state of the stratified split")
    d.set_defaults(func=_run_digits)
