"""The generic training loop of ``ttt-zoo train``; a :class:`~ttt_zoo.train.task.Task` supplies model, data and loss.

timm's components do the work: ``create_optimizer_v2`` (on the task's parameter groups, which may carry
``lr_scale``), ``create_scheduler_v2`` (stepped per optimizer update), ``NativeScaler`` (float16 AMP),
``dispatch_clip_grad``; torch's DDP averages gradients under torchrun.  The run folder (timm's layout) has one
owner, :mod:`ttt_zoo.run_folder`; only rank 0 writes it, through :class:`~ttt_zoo.run_folder.RunWriter`.

The Trainer reads top-down in parts that each fit on a screen: building (:mod:`.building`: folder, model,
optimizer, data, schedule, record, resume), the loop (:mod:`.loop`), evaluation (:mod:`.evaluation`) and committing
(:mod:`.committing`); this file runs the epochs.  Ctrl-C (SIGINT) and SIGTERM stop a run between two steps (never
inside a commit) with one line: exit 130 / 143 (:mod:`.signals`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, Optional, Sequence

from ttt_zoo import run_folder

from .building import Building
from .committing import Committing
from .distributed import barrier, destroy_distributed
from .evaluation import Evaluation
from .loop import Loop
from .run_args import parse_with_run_args, resolve_lr as _resolve_lr  # noqa: F401  (the tests' name)
from .signals import Stopped, signals_set_flag

__all__ = ["Trainer", "Stopped", "main"]


class Trainer(Building, Loop, Evaluation, Committing):
    def __init__(self, args: argparse.Namespace, task_cls: type):
        self.args = args
        self.task_cls = task_cls
        self.writer = run_folder.RunWriter()  # rank 0's hold on the run folder (its lock), released when run() ends
        self._signal: Dict[str, int] = {}  # {"signum": N} once SIGINT / SIGTERM arrived
        self._where = "before its first step"

    def run(self) -> Dict[str, Any]:
        with signals_set_flag(self._signal):
            try:
                return self._run()
            except Stopped:
                raise
            except BaseException as e:
                if self._signal and isinstance(e, Exception):  # e.g. a DataLoader worker that the Ctrl-C ended
                    signum = self._signal["signum"]
                    raise Stopped(signum, self._stop_line(signum)) from e
                if getattr(self, "dist", None) is None or self.dist.is_primary:
                    self.writer.remove_failed_start(getattr(self, "log", None))
                raise
            finally:
                try:
                    destroy_distributed()
                finally:
                    self.writer.close()

    def _run(self) -> Dict[str, Any]:
        a = self.args
        self.setup()
        if a.sched_on_updates:  # the lr of the first update (lr_scale applied)
            self.scheduler.step_update(num_updates=self.num_updates)
        else:
            self.scheduler.step(self.start_epoch)
        row: Dict[str, Any] = {}
        end = self.num_epochs if a.stop_after is None else min(self.num_epochs, a.stop_after)
        self.end_epoch = end  # (the run's ETA in the progress lines)
        for epoch in range(self.start_epoch, end):
            row = self._epoch(epoch)
            barrier()
            self._where = f"after epoch {epoch}"
            self._stop_if_signalled()  # (with DDP the only place: one collective per epoch)
        if self.best_metric is not None:
            self.log.info(f"best eval_{self.eval_metric} {self.best_metric:.4f} at epoch {self.best_epoch}")
        return {"folder": self.folder, "best_metric": self.best_metric, "best_epoch": self.best_epoch, "last": row}

    def _epoch(self, epoch: int) -> Dict[str, Any]:
        """Train, evaluate and commit one epoch; its summary row."""
        sampler = getattr(self.train_loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        lr = self._base_lr()
        train = self.train_one_epoch(epoch)
        t0 = time.perf_counter()
        evals = self._evaluate(epoch)
        metric = evals.get(self.eval_metric)
        if not self.args.sched_on_updates:
            self.scheduler.step(epoch + 1, metric)
        better = self._is_better(metric)
        if better:
            self.best_metric, self.best_epoch = metric, epoch
        row = {"epoch": epoch, "train_loss": train["loss"], **{f"eval_{k}": v for k, v in evals.items()},
               "lr": lr, "train_img_per_sec": train["img_per_sec"], "epoch_time": train["time"]}
        self._commit(epoch, row, metric, better)
        self.after_train_s = time.perf_counter() - t0  # (the run's ETA of the next epochs)
        return row


def main(argv: Optional[Sequence[str]] = None, prog: str = "ttt-zoo train") -> int:
    args, task_cls = parse_with_run_args(argv, prog)
    try:
        Trainer(args, task_cls).run()
    except Stopped as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(e, file=sys.stderr)
        return e.exit_code
    return 0
