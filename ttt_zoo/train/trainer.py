"""The generic training loop of ``ttt-zoo train``; a :class:`~ttt_zoo.train.task.Task` supplies model, data and loss.

timm's components do the work: ``create_optimizer_v2`` (on the task's parameter groups, which may carry
``lr_scale``), ``create_scheduler_v2`` (stepped per optimizer update), ``NativeScaler`` (float16 AMP),
``dispatch_clip_grad``, ``AverageMeter``; torch's DDP averages gradients under torchrun.
The experiment folder (timm's layout, its names in :mod:`ttt_zoo.run_folder`) holds the arguments, the summary, the
log, the plot and the checkpoints committed by :mod:`ttt_zoo.train.run_state`.  Only rank 0 writes files.
Ctrl-C (SIGINT) and SIGTERM stop a run between two steps (never inside a commit) with one line: exit 130 / 143.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from datetime import datetime
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from ttt_zoo import run_folder
from ttt_zoo.fileio import LOCK_NAME, atomic_write, folder_lock
from ttt_zoo.torchcompile import check_torchcompile, compile_model, mark_step

from . import run_state
from .args import parse_args
from .distributed import (DistInfo, all_gather_object, all_reduce_sum, barrier, broadcast_object,
                          destroy_distributed, init_distributed)
from .reporting import Summary, setup_logging, write_plot

__all__ = ["Trainer", "main"]


def _resolve_lr(args: argparse.Namespace, world_size: int) -> None:
    """timm's rule: without --lr, scale --lr-base by the global batch (linear for SGD, sqrt for adaptive)."""
    if args.lr is not None:
        return
    ratio = args.batch_size * world_size * args.grad_accum_steps / args.lr_base_size
    scale = args.lr_base_scale or ("sqrt" if any(o in args.opt.lower() for o in ("ada", "lamb")) else "linear")
    args.lr = args.lr_base * (ratio ** 0.5 if scale == "sqrt" else ratio)


def _usage(msg: str) -> SystemExit:
    return SystemExit(f"ttt-zoo train: error: {msg}")


def _check_flags(a: argparse.Namespace) -> None:
    """Numbers that would only fail deep inside timm or torch (or train on NaN), refused before anything starts."""
    if a.epochs < 1:
        raise _usage(f"--epochs {a.epochs}: a run needs at least one epoch; give --epochs 1 or more")
    if a.batch_size < 1 or a.grad_accum_steps < 1:
        raise _usage("--batch-size and --grad-accum-steps must be at least 1; give positive values")
    if a.img_size is not None and a.img_size < 1:
        raise _usage(f"--img-size {a.img_size}: not a positive size; give e.g. --img-size 224, or leave it out "
                     f"for the model's own")
    check_torchcompile(getattr(a, "torchcompile", None), getattr(a, "torchcompile_mode", None))
    for flag in ("lr", "lr_base", "weight_decay", "momentum", "warmup_lr", "min_lr"):
        v = getattr(a, flag, None)
        if v is not None and not math.isfinite(v):
            raise _usage(f"--{flag.replace('_', '-')} {v}: not a finite number; give a finite value, e.g. "
                         f"--lr 0.001")


# flags that fix the model's shape or the optimizer's state: a resumed run must keep them
_SAME_ON_RESUME = ("task", "model", "linearize_from", "model_kwargs", "num_classes", "img_size", "opt",
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


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _parse_with_run_args(argv: Sequence[str], prog: str):
    """``parse_args``; with ``--resume RUN`` the run's recorded arguments are the defaults (the command line
    overrides them), and a changed model shape or optimizer is refused, naming the flag."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--resume", default="")
    pre.add_argument("--task", default=None)
    first, _ = pre.parse_known_args(list(argv))
    if not first.resume:
        return parse_args(argv, prog)
    folder, _ = run_state.resolve_resume(first.resume)
    recorded = run_folder.recorded_args(folder)
    if not recorded:
        return parse_args(argv, prog)
    argv = list(argv)
    if first.task is None and recorded.get("task"):
        argv = ["--task", str(recorded["task"])] + argv
    args, task_cls = parse_args(argv, prog)
    given = _explicit(argv, task_cls, prog)
    record = run_folder.read_record(folder)
    for k in _SAME_ON_RESUME + _RESTORED_ON_RESUME:
        if k not in given or k not in recorded:
            continue
        theirs = recorded[k]
        if k == "num_classes" and theirs is None:  # the run took its classes from its data
            theirs = record.get("num_classes")
        if getattr(args, k, None) != theirs and theirs is not None and not (
                k == "model_kwargs" and dict(args.model_kwargs or {}) == dict(theirs or {})):
            why = ("the optimizer state the run resumes holds its own" if k in _RESTORED_ON_RESUME
                   else "it fixes the model's shape or the optimizer")
            raise _usage(f"--resume {first.resume}: {_flag(k)} {getattr(args, k)!r} differs from the run's "
                         f"{theirs!r} ({why}); leave out {_flag(k)} (the run's own is used), or start a new run "
                         f"with --initial-checkpoint")
    done = run_folder.committed_epoch(folder)
    if "epochs" in given and done and args.epochs < done:
        raise _usage(f"--resume {first.resume}: --epochs {args.epochs}, but the run has already committed {done} "
                     f"epochs; give --epochs {done + 1} or more to train further")
    for k, v in recorded.items():
        if k not in given and k not in _NOT_INHERITED and hasattr(args, k):
            setattr(args, k, v)
    if "data_dir" not in given and record.get("data_dir"):  # the run's own data, as an absolute real path
        args.data_dir = record["data_dir"]
    return args, task_cls


def _check_restartable(folder: str) -> None:
    """An existing ``--experiment`` folder is started again only when it holds a run that committed nothing (a run
    killed before its first epoch): nothing in it can be lost. Anything else is refused, saying what it holds."""
    if not os.path.isdir(folder):
        raise ValueError(f"--experiment: {folder} exists and is not a folder; give a fresh --experiment NAME (or "
                         f"another --output).")
    epoch = run_folder.committed_epoch(folder)
    if epoch is not None:
        what = f"epoch {epoch}" if epoch else "a checkpoint"
        raise ValueError(f"Experiment folder {folder} already exists and holds a run ({what} committed); nothing was "
                         f"changed in it. To continue that run use --resume {folder}; to start a new one give a "
                         f"fresh --experiment NAME (or another --output).")
    ours = {run_folder.ARGS, run_folder.LOG, LOCK_NAME}
    other = sorted(n for n in os.listdir(folder) if n not in ours and not run_folder.is_stale_temp(n))
    if other:
        raise ValueError(f"Experiment folder {folder} already exists and holds files that are not a ttt-zoo run's "
                         f"({', '.join(other[:5])}); nothing was changed in it. Give a fresh --experiment NAME (or "
                         f"another --output).")


def _first_error(fn) -> Optional[str]:
    try:
        fn()
    except (OSError, ValueError) as e:
        return str(e)
    return None


def _raise_everywhere(err: Optional[str], dist: DistInfo) -> None:
    """Rank 0 checked something; every rank raises its error (no rank is left waiting in a collective)."""
    err = broadcast_object(err) if dist.distributed else err
    if err:
        raise SystemExit(f"ttt-zoo train: error: {err}")


class Stopped(Exception):
    """Ctrl-C (SIGINT) or SIGTERM stopped the run between two steps; ``str()`` is the one line to print."""

    def __init__(self, signum: int, line: str):
        super().__init__(line)
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_set_flag(flag: Dict[str, int]):
    """While the run lasts, SIGINT / SIGTERM only record themselves in ``flag``: the loop stops at its next step
    (so a commit in progress always completes). Only the main thread can own signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def record(signum, _frame):
        flag.setdefault("signum", signum)
    old = {sig: signal.signal(sig, record) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


class Trainer:
    def __init__(self, args: argparse.Namespace, task_cls: type):
        self.args = args
        self.task_cls = task_cls
        self._folder_locks = contextlib.ExitStack()  # rank 0's lock of the run folder, released when run() ends
        self._signal: Dict[str, int] = {}  # {"signum": N} once SIGINT / SIGTERM arrived
        self._where = "before its first step"

    def _lock_folder(self, folder: str) -> None:
        """One writer per run folder: a second run on it (e.g. another --resume) is refused, naming our PID."""
        try:
            self._folder_locks.enter_context(folder_lock(folder, "ttt-zoo train"))
        except OSError as e:
            raise OSError(f"Output folder {folder!r} is not writable ({e.strerror or e}): its lock file cannot be "
                          f"created. Choose another --output, or fix its permissions / mount.") from e

    # ----- setup -----
    def _experiment_folder(self) -> str:
        a, d = self.args, self.dist
        if a.resume:
            folder, _ = run_state.resolve_resume(a.resume)

            def lock_and_recover():  # with the lock held: finish / discard a commit cut off by a kill
                self._lock_folder(folder)
                run_state.recover(folder)
                return run_state.resolve_resume(a.resume)[1]  # again, now that no other run can commit
            resume, err = None, None
            if d.is_primary:
                try:
                    resume = lock_and_recover()
                except (OSError, ValueError) as e:
                    err = str(e)
            _raise_everywhere(err, d)
            self.resume_file = broadcast_object(resume) if d.distributed else resume
            if resume is None and d.is_primary:
                print(f"{folder}: no epoch was committed; the run starts again from its {run_folder.ARGS}",
                      file=sys.stderr)
            return folder
        name = a.experiment or "-".join([datetime.now().strftime("%Y%m%d-%H%M%S"),
                                         (a.model or getattr(a, "linearize_from", "") or a.task).replace("/", "_"),
                                         str(a.img_size or "default")])
        folder = broadcast_object(os.path.abspath(os.path.join(a.output, name)))

        def create():
            self.created_folder = folder
            if os.path.exists(folder):
                self.created_folder = None
                _check_restartable(folder)  # a run that committed nothing and is dead: started again in place
                self._lock_folder(folder)
                _check_restartable(folder)  # again, with the lock held
                run_folder.remove_stale_temps(folder)
                return
            try:
                os.makedirs(folder)
            except OSError as e:
                self.created_folder = None
                raise OSError(f"Cannot create the experiment folder {folder} ({e.strerror or e}): --output "
                              f"{a.output!r} is not writable; choose another --output") from e
            self._lock_folder(folder)  # created by us just now; a failed lock removes it (_remove_failed_start)
        _raise_everywhere(_first_error(create) if d.is_primary else None, d)
        return folder

    def setup(self) -> None:
        a = self.args
        self.dist = d = init_distributed(a.device)
        from timm.utils import random_seed
        random_seed(a.seed, d.rank)
        _check_flags(a)
        _resolve_lr(a, d.world_size)
        if not math.isfinite(a.lr):
            raise _usage(f"--lr {a.lr}: not a finite number; give a finite --lr, e.g. --lr 0.001")
        if getattr(a, "data_dir", None) and not getattr(a, "dataset", ""):  # recorded as an absolute real path
            a.data_dir = os.path.realpath(a.data_dir)
        if getattr(a, "initial_checkpoint", None):  # checked against its run's manifest (a run folder: its weights)
            a.initial_checkpoint = run_folder.resolve_checkpoint(a.initial_checkpoint, "--initial-checkpoint").weights
        self.resume_file = None
        self.folder = self._experiment_folder()
        if d.is_primary and not self.resume_file:  # the first file: what `--resume` restarts from after a kill
            self._write_args(run_folder.ARGS)
        self.log = setup_logging(os.path.join(self.folder, run_folder.LOG), d.is_primary)
        self.task = task = self.task_cls(a, d)
        self.eval_metric = a.eval_metric or task.eval_metric

        model = task.build_model().to(d.device)
        self.record = self._record(model)
        if a.grad_checkpointing:
            model.set_grad_checkpointing(True)
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        if a.sync_bn and d.distributed and has_bn:
            if d.device.type != "cuda":
                raise SystemExit("ttt-zoo train: error: --sync-bn needs GPUs (torch's SyncBatchNorm has no CPU "
                                 "implementation); leave out --sync-bn on CPU.")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        elif a.sync_bn and not has_bn:
            self.log.info("--sync-bn: the model has no BatchNorm; nothing to convert")
        self.model = model

        from timm.optim import create_optimizer_v2
        groups = task.param_groups(model, a.weight_decay)
        opt_kw = dict(momentum=a.momentum)
        if a.opt_eps is not None:
            opt_kw["eps"] = a.opt_eps
        if a.opt_betas is not None:
            opt_kw["betas"] = tuple(a.opt_betas)
        self.optimizer = create_optimizer_v2(groups, opt=a.opt, lr=a.lr, weight_decay=a.weight_decay, **opt_kw)

        self.amp_dtype = torch.bfloat16 if a.amp_dtype == "bfloat16" else torch.float16
        self.scaler = None
        if a.amp and self.amp_dtype == torch.float16:
            from timm.utils import NativeScaler
            self.scaler = NativeScaler(device=d.device.type)
        self.ema = task.build_ema(model)
        self.train_model = model
        if d.distributed:
            from torch.nn.parallel import DistributedDataParallel
            self.train_model = DistributedDataParallel(
                model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
        # as timm's train.py: compiled after DDP; self.model (EMA, clipping, checkpoints, evaluation) stays uncompiled
        self.train_model = compile_model(self.train_model, getattr(a, "torchcompile", None),
                                         getattr(a, "torchcompile_mode", None))

        self.train_loader, self.eval_loader = task.build_loaders()
        self.updates_per_epoch = math.ceil(len(self.train_loader) / a.grad_accum_steps)
        from timm.scheduler import create_scheduler_v2, scheduler_kwargs
        a.sched_on_updates = not a.sched_on_epochs
        self.scheduler, self.num_epochs = create_scheduler_v2(
            self.optimizer, **scheduler_kwargs(a, decreasing_metric=task.eval_mode == "min"),
            updates_per_epoch=self.updates_per_epoch)

        self.start_epoch, self.num_updates = 0, 0
        self.best_metric, self.best_epoch = None, None
        self.summary = Summary(os.path.join(self.folder, run_folder.SUMMARY))
        if self.resume_file:
            self._resume(self.resume_file)

        need = 4 * run_state.estimate_checkpoint_bytes(model, ema=self.ema is not None)
        _raise_everywhere(_first_error(lambda: run_state.check_output_dir(self.folder, need)) if d.is_primary else None,
                          d)
        if d.is_primary and self.resume_file:
            self._write_args(run_folder.resume_args_name(self.start_epoch))
        n_params = sum(p.numel() for p in model.parameters())
        self.log.info(f"{type(model).__name__}: {n_params / 1e6:.3f}M params; {d.world_size} process(es) on "
                      f"{d.device.type}; lr {a.lr:g}; {self.updates_per_epoch} updates/epoch; "
                      f"{len(self.optimizer.param_groups)} param groups "
                      f"(lr_scale {sorted({g.get('lr_scale', 1.0) for g in self.optimizer.param_groups})}); "
                      f"output {self.folder}")

    def _record(self, model: nn.Module) -> Dict[str, Any]:
        """The run record (``run.json``, committed with every epoch): the model as built, so that every command
        rebuilds it from the run folder alone, its classes and its data. On resume, other data must have the
        run's classes."""
        a = self.args
        spec = getattr(model, "build_spec", None) or {"model": a.model, "model_kwargs": dict(a.model_kwargs or {})}
        kwargs = dict(spec["model_kwargs"])
        if "num_classes" in kwargs and hasattr(model, "num_classes"):  # (a head reset after linearizing)
            kwargs["num_classes"] = model.num_classes
        names = getattr(self.task, "class_names", None)
        record = {"format": run_folder.RECORD_FORMAT, "task": a.task, "model": spec["model"], "model_kwargs": kwargs,
                  "linearize_from": getattr(a, "linearize_from", "") or None,
                  "num_classes": getattr(model, "num_classes", None), "img_size": a.img_size,
                  "crop_pct": getattr(a, "crop_pct", None), "data_dir": a.data_dir,
                  "class_names": list(names) if names is not None else None, "epochs": a.epochs, "lr": a.lr}
        if a.resume:
            self._check_resumed_data(run_folder.read_record(self.folder), record)
        return record

    def _check_resumed_data(self, old: Dict[str, Any], new: Dict[str, Any]) -> None:
        if not old.get("data_dir") or old["data_dir"] == new["data_dir"]:
            return
        if old.get("class_names") is not None and old["class_names"] != new["class_names"]:
            theirs, ours = old["class_names"], new["class_names"] or []
            diff = sorted(set(theirs) ^ set(ours)) or ["the same names in another order"]
            raise _usage(f"--resume {self.folder} --data-dir {new['data_dir']}: its classes differ from the run's "
                         f"(data {old['data_dir']}; differing: {', '.join(map(str, diff[:8]))}); resume on the run's "
                         f"own data (leave out --data-dir), or start a new run with --initial-checkpoint")
        if self.dist.is_primary:
            print(f"--data-dir {new['data_dir']}: the same {len(new['class_names'] or [])} classes as the run's data "
                  f"{old['data_dir']}; training continues on it (recorded in {run_folder.RECORD})", file=sys.stderr)

    def _write_args(self, name: str) -> None:
        import yaml
        atomic_write(os.path.join(self.folder, name),
                     yaml.safe_dump(dict(vars(self.args), world_size=self.dist.world_size), sort_keys=False))

    def _resume(self, path: str) -> None:
        d, a = self.dist, self.args
        s = run_state.load_state(path)
        saved = s.get("args") or {}
        for k in _SAME_ON_RESUME:  # also when args.yaml is missing
            if k in saved and hasattr(a, k) and saved[k] != getattr(a, k):
                raise _usage(f"--resume {path}: {_flag(k)} {getattr(a, k)!r} differs from the run's {saved[k]!r}; "
                             f"resume with the run's own {_flag(k)}, or start a new run with --initial-checkpoint")
        try:
            self.model.load_state_dict(s["model"])
        except RuntimeError as e:
            first = str(e).split("\n\t")[1:2] or [str(e)[:200]]
            raise _usage(f"--resume {path}: the checkpoint does not fit the model built from these flags "
                         f"({first[0].strip()}); resume with the run's own --model / --model-kwargs / "
                         f"--num-classes / --img-size") from None
        if self.ema is not None:
            if s.get("ema") is None:
                raise SystemExit(f"ttt-zoo train: error: {path} has no EMA state; resume without --model-ema.")
            self.ema.load_state_dict(s["ema"])
        try:
            self.optimizer.load_state_dict(s["optimizer"])
        except ValueError as e:
            raise _usage(f"--resume {path}: the optimizer state does not fit ({e}); resume with the run's own "
                         f"--opt / --layer-decay / --weight-decay") from None
        old_keys = {k for g in s["optimizer"].get("param_groups", []) for k in g}
        new_keys = {k for g in self.optimizer.param_groups for k in g}
        if old_keys and old_keys != new_keys:
            raise _usage(f"--resume {path}: the run's optimizer differs from --opt {a.opt} (its settings "
                         f"{sorted(old_keys ^ new_keys)} differ); resume with the run's own --opt")
        from timm.scheduler import PlateauLRScheduler
        if isinstance(self.scheduler, PlateauLRScheduler):  # the only timm schedule with state of its own
            self.scheduler.load_state_dict(s["scheduler"])
        # the others are functions of the update count: built from these flags, they follow a changed --epochs or
        # --lr (recorded in args.resume-epoch<N>.yaml and run.json), and equal the saved one when nothing changed
        if self.scaler is not None and s.get("scaler"):
            self.scaler.load_state_dict(s["scaler"])
        self.task.load_state_dict(s.get("task", {}))
        self.start_epoch, self.num_updates = int(s["epoch"]), int(s["num_updates"])
        self._say_changes(saved)
        self.best_metric, self.best_epoch = s.get("best_metric"), s.get("best_epoch")
        rng = s.get("rng") or []
        if len(rng) == d.world_size:
            run_state.set_rng_state(rng[d.rank])
        else:
            self.log.warning(f"resume: saved with {len(rng)} process(es), now {d.world_size}: RNG streams reseeded")
        if d.is_primary:
            self.summary.load(self.start_epoch)
        self.log.info(f"resumed {path} at epoch {self.start_epoch} ({self.num_updates} updates)")

    def _say_changes(self, saved: Dict[str, Any]) -> None:
        a = self.args
        for k in ("epochs", "lr", "data_dir"):
            if k in saved and saved[k] != getattr(a, k, None):
                self.log.info(f"resume: {_flag(k)} {saved[k]} -> {getattr(a, k)} from epoch {self.start_epoch} "
                              f"(recorded in {run_folder.resume_args_name(self.start_epoch)})")

    # ----- loop -----
    def _autocast(self):
        return torch.autocast(device_type=self.dist.device.type, dtype=self.amp_dtype, enabled=self.args.amp)

    def _base_lr(self) -> float:
        g = self.optimizer.param_groups[0]
        return g["lr"] / g.get("lr_scale", 1.0)

    def train_one_epoch(self, epoch: int) -> Dict[str, float]:
        from timm.utils import dispatch_clip_grad
        a, d, task = self.args, self.dist, self.task
        model, opt = self.train_model, self.optimizer
        model.train()
        n_batches = len(self.train_loader)
        accum = a.grad_accum_steps
        last_group = n_batches - (n_batches % accum or accum)  # first batch of the last (maybe short) group
        loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
        seen = 0
        use_bar = d.is_primary and sys.stderr.isatty()
        bar = None
        if use_bar:
            from tqdm import tqdm
            bar = tqdm(total=n_batches, desc=f"epoch {epoch}", leave=False, dynamic_ncols=True)
        t0 = t_log = time.perf_counter()
        seen_log = 0
        opt.zero_grad(set_to_none=True)
        for i, batch in enumerate(self.train_loader):
            need_update = (i + 1) % accum == 0 or i == n_batches - 1
            steps = (n_batches - last_group) if i >= last_group else accum
            sync = model.no_sync() if d.distributed and not need_update else contextlib.nullcontext()
            mark_step(getattr(a, "torchcompile", None) is not None)  # reduce-overhead: a new CUDA graph replay
            with sync:
                with self._autocast():
                    loss, extras = task.train_step(model, batch)
                scaled = loss / steps
                if self.scaler is not None:
                    self.scaler(scaled, opt, clip_grad=a.clip_grad, clip_mode=a.clip_mode,
                                parameters=self.model.parameters(), need_update=need_update)
                else:
                    scaled.backward()
                    if need_update:
                        if a.clip_grad is not None:
                            dispatch_clip_grad(self.model.parameters(), a.clip_grad, mode=a.clip_mode)
                        opt.step()
            bs = task.batch_size(batch)
            loss_sum += loss.detach().double() * bs
            seen += bs
            if need_update:
                opt.zero_grad(set_to_none=True)
                self.num_updates += 1
                if self.ema is not None:
                    self.ema.update(self.model, step=self.num_updates)
                if a.sched_on_updates:
                    self.scheduler.step_update(num_updates=self.num_updates)
            if bar is not None:
                bar.update(1)
            self._where = f"in epoch {epoch} after step {i + 1} of {n_batches}"
            if not d.distributed:
                self._stop_if_signalled()
            if (i + 1) % a.log_interval == 0 or i == n_batches - 1:
                now = time.perf_counter()
                rate = (seen - seen_log) * d.world_size / max(now - t_log, 1e-9)
                if not d.distributed and not math.isfinite(loss.item()):
                    raise self._non_finite(epoch, loss.item())
                msg = dict(loss=f"{loss.item():.4f}", lr=f"{self._base_lr():.3g}", img_s=f"{rate:.0f}",
                           **{k: f"{v:.4g}" for k, v in extras.items()})
                if bar is not None:
                    bar.set_postfix(msg)
                elif d.is_primary:
                    self.log.info(f"train epoch {epoch} [{i + 1}/{n_batches}] " +
                                  " ".join(f"{k} {v}" for k, v in msg.items()))
                t_log, seen_log = now, seen
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        total_loss, total_seen = all_reduce_sum([loss_sum.item(), seen], d.device)
        if not math.isfinite(total_loss):
            raise self._non_finite(epoch, total_loss)
        return {"loss": total_loss / max(total_seen, 1), "img_per_sec": total_seen / max(elapsed, 1e-9),
                "time": elapsed}

    def _stop_if_signalled(self) -> None:
        """Raise :class:`Stopped` once a stop signal arrived (with DDP: on every rank once any rank got one)."""
        got = self._signal.get("signum", 0)
        if self.dist.distributed:
            got = int(all_reduce_sum([float(got)], self.dist.device)[0] > 0) and (got or signal.SIGTERM)
        if got:
            raise Stopped(got, self._stop_line(got))

    def _stop_line(self, signum: int) -> str:
        folder = getattr(self, "folder", None)
        name = signal.Signals(signum).name
        try:
            epoch = run_folder.committed_epoch(folder) if folder else None
        except ValueError:
            epoch = None
        if epoch is not None:  # (0: a folder from before manifests, which only its state's epoch knows)
            done = f"{epoch} epoch{'s' if epoch != 1 else ''} committed" if epoch else "its checkpoint is kept"
            return (f"ttt-zoo train: stopped by {name} {self._where}; {done}: continue with `ttt-zoo train "
                    f"--resume {folder}`")
        if folder and os.path.isfile(os.path.join(folder, run_folder.ARGS)):
            return (f"ttt-zoo train: stopped by {name} {self._where}; no epoch was committed: start the run again "
                    f"with `ttt-zoo train --resume {folder}`")
        return f"ttt-zoo train: stopped by {name} {self._where}; nothing was written: run the same command again"

    def _non_finite(self, epoch: int, value: float) -> SystemExit:
        return _usage(f"the training loss of epoch {epoch} is {value} (not finite); nothing of this epoch was saved "
                      f"and best.* is unchanged; lower --lr, add --clip-grad 1.0, or check the data and --amp")

    def _evaluate(self) -> Dict[str, float]:
        if self.eval_loader is None:
            return {}
        out = {}
        for prefix, module in (("", self.model), ("ema_", self.ema.module if self.ema is not None else None)):
            if module is None:
                continue
            was = module.training
            module.eval()
            with torch.no_grad(), self._autocast():
                out.update({prefix + k: v for k, v in self.task.evaluate(module, self.eval_loader).items()})
            module.train(was)
        return out

    def _is_better(self, metric: Optional[float]) -> bool:
        if metric is None or not math.isfinite(metric):
            return False
        if self.best_metric is None:
            return True
        return metric > self.best_metric if self.task.eval_mode == "max" else metric < self.best_metric

    def _save(self, epoch_done: int, metric: Optional[float], better: bool, summary_csv: str) -> None:
        """Commit the epoch: last.*, best.* when ``better``, and summary.csv, as one atomic set."""
        d = self.dist
        rngs = all_gather_object(run_state.rng_state())  # every rank's, so every rank resumes its own streams
        if not d.is_primary:
            return
        state = {"epoch": epoch_done, "num_updates": self.num_updates, "metric": metric,
                 "best_metric": self.best_metric, "best_epoch": self.best_epoch,
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                 "ema": self.ema.state_dict() if self.ema is not None else None,
                 "task": self.task.state_dict(), "rng": rngs, "world_size": d.world_size,
                 "args": {k: v for k, v in vars(self.args).items()}}
        meta = {"epoch": epoch_done, "arch": self.args.model or getattr(self.args, "linearize_from", "") or "", "metric": metric,
                "task": self.task.name}
        run_state.commit_epoch(self.folder, state, self.model.state_dict(),
                               self.ema.module.state_dict() if self.ema is not None else None, meta, best=better,
                               summary_csv=summary_csv, record=self.record)

    def _remove_failed_start(self) -> None:
        """A run that failed before saving anything removes the folder it created (so the same command works)."""
        folder = getattr(self, "created_folder", None)
        if not folder or self.saved or not os.path.isdir(folder):
            return
        import shutil
        log = getattr(self, "log", None)
        for h in list(getattr(log, "handlers", [])):
            if isinstance(h, logging.FileHandler):
                log.removeHandler(h)
                h.close()
        shutil.rmtree(folder, ignore_errors=True)

    def run(self) -> Dict[str, Any]:
        a = self.args
        self.created_folder, self.saved = None, False
        with _signals_set_flag(self._signal):
            return self._run()

    def _run(self) -> Dict[str, Any]:
        a = self.args
        try:
            self.setup()
            d = self.dist
            if a.sched_on_updates:  # the lr of the first update (lr_scale applied)
                self.scheduler.step_update(num_updates=self.num_updates)
            else:
                self.scheduler.step(self.start_epoch)
            row: Dict[str, Any] = {}
            end = self.num_epochs if a.stop_after is None else min(self.num_epochs, a.stop_after)
            for epoch in range(self.start_epoch, end):
                sampler = getattr(self.train_loader, "sampler", None)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)
                lr = self._base_lr()
                train = self.train_one_epoch(epoch)
                evals = self._evaluate()
                bad = {k: v for k, v in evals.items() if not math.isfinite(v)}
                if bad:
                    raise _usage(f"epoch {epoch}: evaluation gave non-finite {bad}; nothing of this epoch was saved "
                                 f"and best.* is unchanged; lower --lr, add --clip-grad 1.0, or check --amp")
                metric = evals.get(self.eval_metric)
                if not a.sched_on_updates:
                    self.scheduler.step(epoch + 1, metric)
                better = self._is_better(metric)
                if better:
                    self.best_metric, self.best_epoch = metric, epoch
                row = {"epoch": epoch, "train_loss": train["loss"], **{f"eval_{k}": v for k, v in evals.items()},
                       "lr": lr, "train_img_per_sec": train["img_per_sec"], "epoch_time": train["time"]}
                self._save(epoch + 1, metric, better, self.summary.render(self.summary.rows + [row]))
                self.saved = True
                self.summary.rows.append(row)
                if d.is_primary:
                    write_plot(self.summary.rows, os.path.join(self.folder, run_folder.PLOT), self.eval_metric)
                    self.log.info(f"epoch {epoch}: train_loss {train['loss']:.4f} " +
                                  " ".join(f"eval_{k} {v:.4f}" for k, v in evals.items()) +
                                  f" lr {lr:.3g} {train['img_per_sec']:.1f} img/s"
                                  + (" (best)" if better else ""))
                barrier()
                self._where = f"after epoch {epoch}"
                self._stop_if_signalled()  # (with DDP the only place: one collective per epoch)
            if self.best_metric is not None:
                self.log.info(f"best eval_{self.eval_metric} {self.best_metric:.4f} at epoch {self.best_epoch}")
            return {"folder": self.folder, "best_metric": self.best_metric, "best_epoch": self.best_epoch,
                    "last": row}
        except Stopped:
            raise
        except BaseException as e:
            if self._signal and isinstance(e, Exception):  # e.g. a DataLoader worker that the Ctrl-C ended
                signum = self._signal["signum"]
                raise Stopped(signum, self._stop_line(signum)) from e
            if getattr(self, "dist", None) is None or self.dist.is_primary:
                self._remove_failed_start()
            raise
        finally:
            try:
                destroy_distributed()
            finally:
                self._folder_locks.close()


def main(argv: Optional[Sequence[str]] = None, prog: str = "ttt-zoo train") -> int:
    args, task_cls = _parse_with_run_args(argv, prog)
    try:
        Trainer(args, task_cls).run()
    except Stopped as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(e, file=sys.stderr)
        return e.exit_code
    return 0
