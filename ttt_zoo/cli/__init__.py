"""The ``ttt-zoo`` command (also ``python -m ttt_zoo``): one module per subcommand, each with ``add_parser(sub)``."""

import argparse
import importlib
import sys
from typing import Optional, Sequence

__all__ = ["main", "build_parser", "COMMANDS"]

COMMANDS = ("list", "demo", "data", "train", "validate", "sample", "attention_map", "convert", "export",
            "push", "bench")  # module names in this package, in --help order


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ttt-zoo", description="Test-Time-Training vision backbones for timm.")
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
