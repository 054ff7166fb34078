"""What several ``ttt-zoo`` commands share: the model-constructor flags and one-line errors."""

import argparse
import json
import sys
from typing import Any, Dict

__all__ = ["add_model_kwargs", "model_kwargs", "cli_errors"]


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--model-args must be a JSON object, e.g. '{{\"depth\": 2}}' ({e})")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--model-args must be a JSON object, e.g. '{\"depth\": 2}'")
    return value


def add_model_kwargs(p: argparse.ArgumentParser) -> None:
    """``--model-kwargs K=V ...`` (timm's train.py spelling, values parsed as Python literals) and its JSON form
    ``--model-args '{...}'``; read both with :func:`model_kwargs`."""
    from timm.utils import ParseKwargs
    p.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="K=V",
                   help="model constructor arguments, e.g. depth=4 embed_dim=96 (as for `ttt-zoo train`)")
    p.add_argument("--model-args", type=_json_object, default=None, metavar="JSON",
                   help="the same as a JSON object, e.g. '{\"depth\": 4, \"embed_dim\": 96}'")


def model_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The constructor arguments of :func:`add_model_kwargs` (``--model-kwargs`` wins on a clash)."""
    return dict(args.model_args or {}, **dict(args.model_kwargs or {}))


def cli_errors(fn):
    """Print ttt-zoo's clear errors (bad checkpoints, hub folders, exports) as one line and exit with status 2
    instead of a traceback."""
    def run(args) -> int:
        from ttt_zoo.checkpoint import CheckpointError
        from ttt_zoo.export import ExportError
        from ttt_zoo.hub import HubFolderError
        try:
            return fn(args)
        except (CheckpointError, HubFolderError, ExportError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return run
