"""``ttt-zoo list [PATTERN ...]``: registered models with parameters, GFLOPs and their released weights.

The numbers at the default size come from ``ttt_zoo/assets/model_stats.json``, a table generated from the
registry by ``python tools/gen_model_stats.py`` and checked against a fresh measurement of every model by
``tests/test_model_stats.py``: listing reads it instead of building 72 models (45 s).  Other sizes, and models
the table lacks, are measured on the meta device.
"""
import difflib
import fnmatch
import json
import os
from typing import Dict, List, Optional, Sequence

__all__ = ["add_parser", "model_stats", "STATS_FILE", "DEFAULT_IMG_SIZE", "load_stats_table", "select_models",
           "closest_names", "pretrained_tags"]

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


def select_models(names: Sequence[str], filters: Sequence[str], exclude: Sequence[str] = ()) -> List[str]:
    """timm's filters: shell wildcards (``'vit3*'``, ``'*_v[1-3]'``) matched against the whole name; a filter
    without a wildcard matches names that contain it.  Several filters: the names any matches (a union), less
    those an ``exclude`` filter matches (timm's ``exclude_filters``)."""
    def matches(name: str, pats: Sequence[str]) -> bool:
        return any(fnmatch.fnmatchcase(name, p if any(c in p for c in "*?[") else f"*{p}*") for p in pats)
    return [n for n in names if (not filters or matches(n, filters)) and not matches(n, exclude)]


def closest_names(pattern: str, names: Sequence[str], n: int = 3) -> List[str]:
    """The ``n`` registered names most like ``pattern`` (difflib's ratio, 0.5 or more), its wildcards left out; a
    pattern ending in ``*`` is compared with each name's start of the same length (ties: the whole name)."""
    text = "".join(c for c in pattern if c not in "*?[]")
    def ratio(name: str) -> float:
        return difflib.SequenceMatcher(None, text, name).ratio()
    score = {m: (ratio(m[:len(text)]) if pattern.endswith("*") else ratio(m), ratio(m)) for m in names}
    return [m for m in sorted(names, key=lambda m: score[m], reverse=True) if score[m][0] >= 0.5][:n]


def pretrained_tags(names: Sequence[str]) -> Dict[str, List[str]]:
    """``{model: its pretrained tags with released weights}`` for each of ``names`` that has any (timm's
    ``list_models(pretrained=True)``: a cfg with a hub id, url or file)."""
    import timm
    tags: Dict[str, List[str]] = {}
    wanted = set(names)
    for tagged in timm.list_models(pretrained=True, include_tags=True):
        name, _, tag = tagged.partition(".")
        if name in wanted:
            tags.setdefault(name, []).append(tag)
    return tags


def run(args) -> int:
    from ttt_zoo.registry import list_zoo_models
    from ._common import UsageError
    registry = list_zoo_models(include_diffusion=True)
    patterns = [*args.patterns, *args.filter]
    weights = pretrained_tags(registry)
    names = select_models(registry, patterns, args.exclude)
    if args.pretrained:
        names = [n for n in names if n in weights]
    if not names:
        asked = " ".join(f"'{p}'" for p in args.patterns) + " --filter " * bool(args.filter) + " ".join(args.filter)
        asked = asked.strip() or "any pattern"
        if args.exclude:
            asked += f" less --exclude {' '.join(args.exclude)}"
        if args.pretrained:
            asked += " with released weights (--pretrained)"
        pool = [n for n in registry if n in weights] if args.pretrained else registry
        near = list(dict.fromkeys(m for p in patterns for m in closest_names(p, pool)))
        raise UsageError(f"no registered model matches {asked}; " + (f"closest: {', '.join(near)}" if near else
                         "use shell wildcards as timm does (e.g. 'vit3*'), or run `ttt-zoo list` for all"))
    table = load_stats_table() if args.img_size == DEFAULT_IMG_SIZE and not args.measure else {}
    print(f"{'model':<22}{'params (M)':>12}{'GFLOPs':>10}  {'input':<11}  pretrained")
    for n in names:
        released = ",".join(weights.get(n, [])) or "-"
        try:
            s = table.get(n) or model_stats(n, args.img_size)
            print(f"{n:<22}{s['params'] / 1e6:>12.3f}{s['gflops']:>10.2f}  {'x'.join(map(str, s['input'])):<11}  "
                  f"{released}")
        except Exception as e:  # noqa: BLE001 - report and continue
            print(f"{n:<22}  (could not be measured: {type(e).__name__}: {e})")
    return 0


def add_parser(sub) -> None:
    from ttt_zoo.flags import MAX_IMG_SIDE, Range
    p = sub.add_parser("list", help="list registered models with parameters, GFLOPs and released weights",
                       description="Registered models with parameters, GFLOPs and their pretrained tags with released "
                       "weights. PATTERN: shell wildcards as in timm.list_models ('vit3*', '*_v[13]'), matched "
                       "against the whole name; plain text matches names that contain it; several: any of them.")
    p.add_argument("patterns", nargs="*", metavar="PATTERN", help="list only the models a pattern matches")
    p.add_argument("--filter", nargs="+", default=[], metavar="PATTERN", help="the same as PATTERN (kept for scripts)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="PATTERN",
                   help="leave out the models these patterns match (timm's exclude_filters)")
    p.add_argument("--pretrained", action="store_true",
                   help="only models with released weights (timm.list_models(pretrained=True))")
    p.add_argument("--img-size", type=Range(int, ge=1, le=MAX_IMG_SIDE), default=DEFAULT_IMG_SIZE,
                   help="image models are measured at this size (the default size reads the generated table)")
    p.add_argument("--measure", action="store_true", help="measure every model now instead of reading the table")
    p.set_defaults(func=run)
