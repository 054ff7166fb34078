"""Command-line flags of ``ttt-zoo train``: timm ``train.py``'s spellings, ``-c/--config`` YAML defaults, ``--task``.

Parsing is two-stage, as in timm: ``-c FILE`` and ``--task`` are read first; the YAML's keys (argparse ``dest``
names, e.g. ``batch_size``, as written to ``args.yaml``) become parser defaults; the command line overrides them.
"""
from __future__ import annotations

import argparse
from typing import List, Optional, Sequence, Tuple, Union

from ttt_zoo import flags
from ttt_zoo.flags import MAX_IMG_SIDE, MAX_SEED, Range
from ttt_zoo.torchcompile import add_torchcompile_args

from .task_flags import TASKS, add_task_args

__all__ = ["build_parser", "parse_args"]

# keys of args.yaml that are not flags (ignored when an args.yaml is used as -c)
_NOT_FLAGS = ("config", "world_size", "sched_on_updates")


def _config_parser() -> argparse.ArgumentParser:
    from .recipes import list_recipes
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-c", "--config", default="", metavar="FILE|RECIPE",
                   help="YAML file of flag defaults (dest names), or a shipped recipe: " + ", ".join(list_recipes()))
    p.add_argument("--task", default=None, choices=sorted(TASKS),
                   help="what to train (default: classification)")
    return p


def build_parser(task: Union[str, type, None] = None, prog: str = "ttt-zoo train") -> argparse.ArgumentParser:
    """The full parser: shared Trainer flags plus the flags of ``task`` (a ``--task`` name, or its Task class),
    from ``task_flags`` (no torch: ``ttt-zoo train --help`` builds it before the package is imported)."""
    p = argparse.ArgumentParser(prog=prog, parents=[_config_parser()],
                                description="Train a ttt-zoo / timm model (one process, or many under torchrun).",
                                formatter_class=flags.DefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="model name (timm registry, ttt-zoo models included)")
    g.add_argument("--model-kwargs", nargs="*", default={}, action=flags.ModelKwargs, metavar="K=V",
                   help="extra model constructor arguments, e.g. depth=2 embed_dim=64")
    g.add_argument("--pretrained", action="store_true", help="start from the model's pretrained weights")
    g.add_argument("--initial-checkpoint", default="", metavar="PATH", help="load these weights before training")
    g.add_argument("--resume", default="", metavar="PATH",
                   help="continue a run from its latest commit: give its folder")
    g.add_argument("--num-classes", type=Range(int, ge=1, le=1_000_000), default=None,
                   help="number of classes (default: the model's)")
    g.add_argument("--img-size", type=Range(int, ge=1, le=MAX_IMG_SIDE), default=None,
                   help="input image size (default: the model's)")
    g.add_argument("--data-dir", default=None, metavar="DIR", help="dataset root")
    g.add_argument("--drop", type=Range(float, ge=0, lt=1), default=0.0, help="dropout rate")
    g.add_argument("--drop-path", type=Range(float, ge=0, lt=1), default=None, help="drop path (stochastic depth) rate")
    g.add_argument("--grad-checkpointing", action="store_true", help="gradient checkpointing through the model")
    g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm under DDP (models with BatchNorm)")
    add_torchcompile_args(g)  # timm's --torchcompile [BACKEND] / --torchcompile-mode

    g = p.add_argument_group("optimizer and schedule (timm)")
    g.add_argument("-b", "--batch-size", type=Range(int, ge=1, le=65536), default=128, help="batch size per process")
    g.add_argument("-vb", "--validation-batch-size", type=Range(int, ge=1, le=65536), default=None,
                   help="eval batch size (default: -b)")
    g.add_argument("--epochs", type=Range(int, ge=1, le=1_000_000), default=300)
    g.add_argument("--stop-after", type=Range(int, ge=1, le=1_000_000), default=None, metavar="N",
                   help="end this run after epoch N (the schedule still spans --epochs); continue with --resume")
    g.add_argument("--opt", default="sgd", help="timm optimizer name (create_optimizer_v2)")
    g.add_argument("--opt-eps", type=Range(float, gt=0, le=1), default=None)
    g.add_argument("--opt-betas", type=Range(float, ge=0, lt=1), nargs="+", default=None)
    g.add_argument("--momentum", type=Range(float, ge=0, lt=1), default=0.9)
    g.add_argument("--weight-decay", type=Range(float, ge=0, le=10), default=2e-5)
    g.add_argument("--layer-decay", type=Range(float, gt=0, le=1), default=None,
                   help="layer-wise lr decay (model.group_matcher)")
    g.add_argument("--clip-grad", type=Range(float, gt=0, le=1e6, hint="; leave out --clip-grad to turn clipping off"),
                   default=None, help="gradient clipping value (off by default)")
    g.add_argument("--clip-mode", default="norm", choices=("norm", "value", "agc"))
    g.add_argument("--grad-accum-steps", type=Range(int, ge=1, le=65536), default=1)
    g.add_argument("--sched", default="cosine", help="timm scheduler (create_scheduler_v2)")
    g.add_argument("--sched-on-epochs", action="store_true",
                   help="step the schedule once per epoch (default: once per optimizer update)")
    g.add_argument("--lr", type=Range(float, gt=0, le=100), default=None,
                   help="learning rate (default: --lr-base scaled by batch)")
    g.add_argument("--lr-base", type=Range(float, gt=0, le=100), default=0.1,
                   help="lr at --lr-base-size (when --lr is not given)")
    g.add_argument("--lr-base-size", type=Range(int, ge=1, le=1_000_000), default=256)
    g.add_argument("--lr-base-scale", default="", choices=("", "linear", "sqrt"),
                   help="'' = linear for SGD, sqrt for adaptive optimizers (as timm)")
    g.add_argument("--warmup-lr", type=Range(float, ge=0, le=100), default=1e-5)
    g.add_argument("--min-lr", type=Range(float, ge=0, le=100), default=0.0)
    g.add_argument("--warmup-epochs", type=Range(int, ge=0, le=1_000_000), default=5)
    g.add_argument("--warmup-prefix", action="store_true")
    g.add_argument("--cooldown-epochs", type=Range(int, ge=0, le=1_000_000), default=0)
    g.add_argument("--decay-epochs", type=Range(float, gt=0, le=1_000_000), default=90)
    g.add_argument("--decay-milestones", type=Range(int, ge=0, le=1_000_000), nargs="+", default=[90, 180, 270])
    g.add_argument("--decay-rate", "--dr", type=Range(float, gt=0, le=1), default=0.1)
    g.add_argument("--patience-epochs", type=Range(int, ge=0, le=1_000_000), default=10)

    g = p.add_argument_group("EMA, precision")
    g.add_argument("--model-ema", action="store_true", help="keep an EMA of the weights (timm ModelEmaV3)")
    g.add_argument("--model-ema-decay", type=Range(float, ge=0, le=1), default=0.9998)
    g.add_argument("--model-ema-warmup", action="store_true")
    g.add_argument("--amp", action="store_true", help="mixed precision (autocast; GradScaler for float16)")
    g.add_argument("--amp-dtype", default="float16", choices=("float16", "bfloat16"))

    g = p.add_argument_group("output and misc")
    g.add_argument("--output", default="./output/train", metavar="DIR", help="parent folder of experiments")
    g.add_argument("--experiment", default="", help="experiment folder name (default: date-model-img_size)")
    g.add_argument("--eval-metric", default=None, help="metric that picks the best checkpoint (default: task's)")
    g.add_argument("--seed", type=Range(int, ge=0, le=MAX_SEED), default=42)
    g.add_argument("-j", "--workers", type=Range(int, ge=0, le=256), default=4,
                   help="data loader processes per training process")
    g.add_argument("--pin-mem", action="store_true")
    g.add_argument("--log-interval", type=Range(int, ge=1, le=1_000_000_000), default=50,
                   help="batches between log lines")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    if task is not None:
        add_task_args(p, task if isinstance(task, str) else task.name)
    return p


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = "ttt-zoo train") -> Tuple[argparse.Namespace, type]:
    """``(args, task_class)`` from ``argv`` (``-c`` YAML first, then the command line)."""
    import yaml
    first, rest = _config_parser().parse_known_args(argv)
    cfg = {}
    if first.config:  # a YAML file, or the name of a shipped recipe (ttt_zoo/train/recipes/)
        from .recipes import resolve_config
        try:
            cfg = resolve_config(first.config) or {}
        except (ValueError, OSError, yaml.YAMLError) as e:
            raise SystemExit(f"{prog}: error: {e}")
        if not isinstance(cfg, dict):
            raise SystemExit(f"{prog}: error: --config {first.config} must hold a mapping of flag names to values.")
    task = first.task or cfg.get("task") or "classification"
    parser = build_parser(task, prog)
    known = {a.dest for a in parser._actions}
    unknown = sorted(k for k in cfg if k not in known and k not in _NOT_FLAGS)
    if unknown:
        parser.error(f"--config {first.config}: unknown keys {unknown}; keys are flag names with '_' for '-' "
                     f"(e.g. batch_size), as in args.yaml.")
    parser.set_defaults(**{k: v for k, v in cfg.items() if k in known})
    args = parser.parse_args(argv)
    flags.check_ranges(parser, args, f" (from --config {first.config})" if first.config else "")
    args.task = task
    from .task import get_task_class  # the task's module (torch) only once the arguments are good
    return args, get_task_class(task)
