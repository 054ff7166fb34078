"""The flags of one ``ttt-zoo train`` invocation: checked before anything starts, and with ``--resume RUN`` merged
with what the run recorded (the command line wins; a flag the resumed state would silently override is refused)."""
from __future__ import annotations

import argparse
import math
from typing import Sequence

from ttt_zoo import run_folder
from ttt_zoo.torchcompile import check_torchcompile

from .args import parse_args

__all__ = ["parse_with_run_args", "resolve_lr", "check_flags", "usage", "flag_name", "SAME_ON_RESUME"]


def resolve_lr(args: argparse.Namespace, world_size: int) -> None:
    """timm's rule: without --lr, scale --lr-base by the global batch (linear for SGD, sqrt for adaptive)."""
    if args.lr is not None:
        return
    ratio = args.batch_size * world_size * args.grad_accum_steps / args.lr_base_size
    scale = args.lr_base_scale or ("sqrt" if any(o in args.opt.lower() for o in ("ada", "lamb")) else "linear")
    args.lr = args.lr_base * (ratio ** 0.5 if scale == "sqrt" else ratio)


def usage(msg: str) -> SystemExit:
    return SystemExit(f"ttt-zoo train: error: {msg}")


def check_flags(a: argparse.Namespace) -> None:
    """Numbers that would only fail deep inside timm or torch (or train on NaN), refused before anything starts."""
    if a.epochs < 1:
        raise usage(f"--epochs {a.epochs}: a run needs at least one epoch; give --epochs 1 or more")
    if a.batch_size < 1 or a.grad_accum_steps < 1:
        raise usage("--batch-size and --grad-accum-steps must be at least 1; give positive values")
    if a.img_size is not None and a.img_size < 1:
        raise usage(f"--img-size {a.img_size}: not a positive size; give e.g. --img-size 224, or leave it out "
                     f"for the model's own")
    check_torchcompile(getattr(a, "torchcompile", None), getattr(a, "torchcompile_mode", None))
    for flag in ("lr", "lr_base", "weight_decay", "momentum", "warmup_lr", "min_lr"):
        v = getattr(a, flag, None)
        if v is not None and not math.isfinite(v):
            raise usage(f"--{flag.replace('_', '-')} {v}: not a finite number; give a finite value, e.g. "
                         f"--lr 0.001")


# flags that fix the model's shape or the optimizer's state: a resumed run must keep them
SAME_ON_RESUME = ("task", "model", "linearize_from", "model_kwargs", "num_classes", "img_size", "opt",
                   "layer_decay", "sched", "sched_on_epochs", "grad_accum_steps")
# flags whose values the resumed optimizer state restores: changing them on --resume would not be applied
_RESTORED_ON_RESUME = ("weight_decay", "momentum", "opt_eps", "opt_betas")
# args.yaml keys that belong to one invocation and are not inherited by --resume
_NOT_INHERITED = ("config", "world_size", "sched_on_updates", "resume", "stop_after", "experiment", "output",
                  "initial_checkpoint", "pretrained")


def _explicit(argv: Sequence[str], task_cls: type, prog: str) -> set:
    """The dest names given on the command line itself (not by defaults or -c)."""
    from .args import build_parser
    p = build_parser(task_cls, prog)
    for act in p._actions:
        act.default = argparse.SUPPRESS
    return set(vars(p.parse_args(list(argv))))


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def parse_with_run_args(argv: Sequence[str], prog: str):
    """``parse_args``; with ``--resume RUN`` the run's recorded arguments are the defaults (the command line
    overrides them), and a changed model shape or optimizer is refused, naming the flag."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--resume", default="")
    pre.add_argument("--task", default=None)
    first, _ = pre.parse_known_args(list(argv))
    if not first.resume:
        return parse_args(argv, prog)
    folder, _ = run_folder.resolve_resume(first.resume)
    recorded = run_folder.recorded_args(folder)
    if not recorded:
        return parse_args(argv, prog)
    argv = list(argv)
    if first.task is None and recorded.get("task"):
        argv = ["--task", str(recorded["task"])] + argv
    args, task_cls = parse_args(argv, prog)
    given = _explicit(argv, task_cls, prog)
    record = run_folder.read_record(folder)
    for k in SAME_ON_RESUME + _RESTORED_ON_RESUME:
        if k not in given or k not in recorded:
            continue
        theirs = recorded[k]
        if k == "num_classes" and theirs is None:  # the run took its classes from its data
            theirs = record.get("num_classes")
        if getattr(args, k, None) != theirs and theirs is not None and not (
                k == "model_kwargs" and dict(args.model_kwargs or {}) == dict(theirs or {})):
            why = ("the optimizer state the run resumes holds its own" if k in _RESTORED_ON_RESUME
                   else "it fixes the model's shape or the optimizer")
            raise usage(f"--resume {first.resume}: {flag_name(k)} {getattr(args, k)!r} differs from the run's "
                         f"{theirs!r} ({why}); leave out {flag_name(k)} (the run's own is used), or start a new run "
                         f"with --initial-checkpoint")
    _refuse_unused_on_resume(first.resume, folder, args, given)
    done = run_folder.committed_epoch(folder)
    if "epochs" in given and done and args.epochs < done:
        raise usage(f"--resume {first.resume}: --epochs {args.epochs}, but the run has already committed {done} "
                     f"epochs; give --epochs {done + 1} or more to train further")
    for k, v in recorded.items():
        if k not in given and k not in _NOT_INHERITED and hasattr(args, k):
            setattr(args, k, v)
    if "data_dir" not in given and record.get("data_dir"):  # the run's own data, as an absolute real path
        args.data_dir = record["data_dir"]
    return args, task_cls


def _refuse_unused_on_resume(resume: str, folder: str, args: argparse.Namespace, given: set) -> None:
    """Flags a resume would record but not use: refused in one line (nothing is recorded that is not used)."""
    for k in ("initial_checkpoint", "pretrained"):
        if k in given and getattr(args, k):
            raise usage(f"--resume {resume} continues the run from its own state, which replaces the weights of "
                        f"{flag_name(k)}; leave out {flag_name(k)}, or start a new run with it")
    import os
    where = os.path.join(args.output, args.experiment) if "experiment" in given else (
        os.path.join(args.output, os.path.basename(folder)) if "output" in given else folder)
    if os.path.realpath(where) != os.path.realpath(folder):
        raise usage(f"--resume {resume} continues the run in {folder}, not in {os.path.abspath(where)}; leave out "
                    f"--output / --experiment (a resume never moves a run)")

