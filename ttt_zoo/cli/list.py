"""``ttt-zoo list``: registered models with parameters and GFLOPs.

The numbers at the default size come from ``ttt_zoo/assets/model_stats.json``, a table generated from the
registry by ``python tools/gen_model_stats.py`` and checked against a fresh measurement of every model by
``tests/test_model_stats.py``: listing reads it instead of building 72 models (45 s).  Other sizes, and models
the table lacks, are measured on the meta device.
"""
import fnmatch
import json
import os
from typing import Dict, List, Optional, Sequence

__all__ = ["add_parser", "model_stats", "STATS_FILE", "DEFAULT_IMG_SIZE", "load_stats_table", "select_models"]

STATS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "model_stats.json")
DEFAULT_IMG_SIZE = 224


def model_stats(name: str, img_size: int = DEFAULT_IMG_SIZE) -> Dict[str, float]:
    """Parameters and GFLOPs (multiply-accumulates, as the papers count them) on the meta device.

    Image models are measured at ``img_size``; diffusion models (``forward(x, t, y)``) at their configured latent size.
    """
    import timm
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from ttt_zoo.hub import example_inputs
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


def load_stats_table(path: str = STATS_FILE) -> Dict[str, Dict]:
    """{model: model_stats(model)} at the default size, as generated; empty when the file is missing."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)["models"]


def select_models(names: Sequence[str], filters: Sequence[str]) -> List[str]:
    """timm's filters: shell wildcards (``'vit3*'``, ``'*_v[1-3]'``) matched against the whole name; a filter
    without a wildcard matches names that contain it."""
    if not filters:
        return list(names)
    wild = [f if any(c in f for c in "*?[") else f"*{f}*" for f in filters]
    return [n for n in names if any(fnmatch.fnmatchcase(n, w) for w in wild)]


def run(args) -> int:
    from ttt_zoo.registry import list_zoo_models
    from ._common import UsageError
    names = select_models(list_zoo_models(include_diffusion=True), args.filter)
    if not names:
        raise UsageError(f"no registered model matches --filter {' '.join(args.filter)}; "
                         "use shell wildcards as timm does (e.g. --filter 'vit3*'), or run `ttt-zoo list` for all")
    table = load_stats_table() if args.img_size == DEFAULT_IMG_SIZE and not args.measure else {}
    print(f"{'model':<22}{'params (M)':>12}{'GFLOPs':>10}  input")
    for n in names:
        try:
            s = table.get(n) or model_stats(n, args.img_size)
            print(f"{n:<22}{s['params'] / 1e6:>12.3f}{s['gflops']:>10.2f}  {'x'.join(map(str, s['input']))}")
        except Exception as e:  # noqa: BLE001 - report and continue
            print(f"{n:<22}  (could not be measured: {type(e).__name__}: {e})")
    return 0


def add_parser(sub) -> None:
    from ttt_zoo.flags import MAX_IMG_SIDE, Range
    p = sub.add_parser("list", help="list registered models with parameters and GFLOPs")
    p.add_argument("--filter", nargs="+", default=[], metavar="PATTERN",
                   help="shell wildcards as in timm.list_models ('vit3*'); plain text matches a substring")
    p.add_argument("--img-size", type=Range(int, ge=1, le=MAX_IMG_SIDE), default=DEFAULT_IMG_SIZE,
                   help="image models are measured at this size (the default size reads the generated table)")
    p.add_argument("--measure", action="store_true", help="measure every model now instead of reading the table")
    p.set_defaults(func=run)
