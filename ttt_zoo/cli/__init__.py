"""The ``ttt-zoo`` command (also ``python -m ttt_zoo``): one module per subcommand, each with ``add_parser(sub)``.

Building the parsers imports no torch, timm or torchvision (import those inside the commands' functions):
``ttt-zoo --help`` runs before the package's ``__init__`` (see ``_ttt_zoo_cli``)."""

import argparse
import importlib
import sys
from typing import Callable, Optional, Sequence

__all__ = ["main", "build_parser", "COMMANDS"]

COMMANDS = ("list", "demo", "data", "train", "validate", "predict", "sample", "attention_map", "convert", "export",
            "push", "bench", "kernels")  # module names in this package, in --help order


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ttt-zoo", description="Test-Time-Training vision backbones for timm.")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error (also accepted anywhere after the command)")
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None, before_command: Optional[Callable[[], None]] = None) -> int:
    """Run one command. A user error prints one ``error: <what>; <how to fix>`` line on stderr and exits with
    status 2 (``SystemExit``; some commands return 2); ``--debug`` (anywhere) prints the traceback too.
    ``before_command``: called once the arguments parsed, before the command runs (the console script imports
    the package there: the parsers import no torch, so ``--help`` is quick)."""
    from ._common import run_command
    argv = [*(sys.argv[1:] if argv is None else argv)]  # (`list` here is the list command module)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]

    def go() -> int:
        args = build_parser().parse_args(argv)
        if getattr(args, "check_args", None) is not None:  # a command's own parse that needs no torch
            args.check_args(args)
        if before_command is not None:
            before_command()
        args.debug = debug
        return args.func(args)
    return run_command(go, debug=debug)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
