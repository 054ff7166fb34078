"""One epoch of training steps, with progress lines and the stop between two steps.  A mixin of
:class:`~ttt_zoo.train.trainer.Trainer`."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from typing import Any, Dict

import torch

from ttt_zoo import run_folder
from ttt_zoo.progress import Progress
from ttt_zoo.torchcompile import mark_step

from .distributed import all_reduce_sum
from .run_args import usage
from .signals import Stopped

__all__ = ["Loop"]


class Loop:
    """``train_one_epoch`` of a :class:`~ttt_zoo.train.trainer.Trainer`."""

    def _autocast(self):
        return torch.autocast(device_type=self.dist.device.type, dtype=self.amp_dtype, enabled=self.args.amp)

    def _base_lr(self) -> float:
        g = self.optimizer.param_groups[0]
        return g["lr"] / g.get("lr_scale", 1.0)

    def train_one_epoch(self, epoch: int) -> Dict[str, float]:
        a, d = self.args, self.dist
        self.train_model.train()
        n_batches = len(self.train_loader)
        accum = a.grad_accum_steps
        last_group = n_batches - (n_batches % accum or accum)  # first batch of the last (maybe short) group
        loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
        seen = 0
        progress = self._progress(epoch, n_batches)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(self.train_loader):
            need_update = (i + 1) % accum == 0 or i == n_batches - 1
            loss, extras = self._step(batch, need_update, (n_batches - last_group) if i >= last_group else accum)
            bs = self.task.batch_size(batch)
            loss_sum += loss.detach().double() * bs
            seen += bs
            progress.update(items=bs * d.world_size, fields=lambda: self._progress_fields(epoch, loss, extras))
            self._where = f"in epoch {epoch} after step {i + 1} of {n_batches}"
            if not d.distributed:
                self._stop_if_signalled()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        elapsed = time.perf_counter() - t0
        progress.close()
        total_loss, total_seen = all_reduce_sum([loss_sum.item(), seen], d.device)
        if not math.isfinite(total_loss):
            raise self._non_finite(epoch, total_loss)
        return {"loss": total_loss / max(total_seen, 1), "img_per_sec": total_seen / max(elapsed, 1e-9),
                "time": elapsed}

    def _step(self, batch: Any, need_update: bool, steps: int):
        """Forward and backward of one batch (``steps`` batches make this update); the update itself when
        ``need_update``. Returns the batch's loss and the task's extras."""
        from timm.utils import dispatch_clip_grad
        a, d, model, opt = self.args, self.dist, self.train_model, self.optimizer
        sync = model.no_sync() if d.distributed and not need_update else contextlib.nullcontext()
        mark_step(getattr(a, "torchcompile", None) is not None)  # reduce-overhead: a new CUDA graph replay
        with sync:
            with self._autocast():
                loss, extras = self.task.train_step(model, batch)
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
        if need_update:
            opt.zero_grad(set_to_none=True)
            self.num_updates += 1
            if self.ema is not None:
                self.ema.update(self.model, step=self.num_updates)
            if a.sched_on_updates:
                self.scheduler.step_update(num_updates=self.num_updates)
        return loss, extras

    def _progress(self, epoch: int, n_batches: int) -> Progress:
        """The epoch's progress: a line (or the bar's postfix) at its first step, every --log-interval steps and its
        last, from the start (no delay); the run's ETA counts the later epochs' steps at this epoch's pace and the
        evaluation and commit time the last epoch took, once for this epoch and each later one."""
        epochs_after = max(getattr(self, "end_epoch", epoch + 1) - epoch - 1, 0)
        after_train = getattr(self, "after_train_s", 0.0)  # evaluation + commit of the last epoch
        return Progress(n_batches, f"train epoch {epoch}", interval=self.args.log_interval, delay=0,
                        later_steps=epochs_after * n_batches, later_s=after_train * (epochs_after + 1),
                        log=self.log.info, also_log=self._log_to_files, enabled=self.dist.is_primary)

    def _progress_fields(self, epoch: int, loss: torch.Tensor, extras: Dict[str, float]) -> Dict[str, str]:
        """A progress line's loss, lr and the task's extras; a non-finite loss ends the run here (one process)."""
        value = loss.item()
        if not self.dist.distributed and not math.isfinite(value):
            raise self._non_finite(epoch, value)
        return dict(loss=f"{value:.4f}", lr=f"{self._base_lr():.3g}", **{k: f"{v:.4g}" for k, v in extras.items()})

    def _log_to_files(self, line: str) -> None:
        """``line`` into the run's log file only (while the terminal shows the bar)."""
        record = self.log.makeRecord(self.log.name, logging.INFO, __file__, 0, line, None, None)
        for handler in self.log.handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)

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
        return usage(f"the training loss of epoch {epoch} is {value} (not finite); nothing of this epoch was saved "
                     f"and best.* is unchanged; lower --lr, add --clip-grad 1.0, or check the data and --amp")
