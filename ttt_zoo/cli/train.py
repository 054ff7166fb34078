"""``ttt-zoo train``: train a model (one process, or many with ``torchrun --nproc_per_node N -m ttt_zoo train``)."""


def add_parser(sub) -> None:
    # the trainer parses its own flags (two stages: -c/--task first); hand every argument through untouched
    p = sub.add_parser("train", add_help=False, prefix_chars="\x01",
                       help="train a model (timm train.py flags; --task classification|diffusion|sd3)")
    p.add_argument("argv", nargs="*")
    p.set_defaults(func=_run, check_args=_help)


def _help(args) -> None:
    """``train -h``: the trainer's parser (no torch) prints its help before the package is imported."""
    if {"-h", "--help"} & set(args.argv):
        from ttt_zoo.train.args import parse_args
        parse_args(args.argv)


def _run(args) -> int:
    from ttt_zoo.train.trainer import main
    return main(args.argv)
