"""Committing an epoch: the training state, the weights, the record and the summary row as one atomic set (by
:class:`~ttt_zoo.run_folder.RunWriter`), then the plot and the log line.  A mixin of
:class:`~ttt_zoo.train.trainer.Trainer`."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

from ttt_zoo import run_folder

from . import run_state
from .distributed import all_gather_object
from .reporting import write_plot

__all__ = ["Committing"]


class Committing:
    def _commit(self, epoch: int, row: Dict[str, Any], metric: Optional[float], better: bool) -> None:
        """Commit epoch ``epoch`` (its summary ``row``), then show it."""
        self._save(epoch + 1, metric, better, self.summary.render(self.summary.rows + [row]))
        self.summary.rows.append(row)
        if self.dist.is_primary:
            write_plot(self.summary.rows, os.path.join(self.folder, run_folder.PLOT), self.eval_metric)
            evals = " ".join(f"{k} {v:.4f}" for k, v in row.items() if k.startswith("eval_"))
            self.log.info(f"epoch {epoch}: train_loss {row['train_loss']:.4f} {evals} lr {row['lr']:.3g} "
                          f"{row['train_img_per_sec']:.1f} img/s" + (" (best)" if better else ""))

    def _save(self, epoch_done: int, metric: Optional[float], better: bool, summary_csv: str) -> None:
        """Commit the epoch: last.*, best.* when ``better``, run.json and summary.csv, as one atomic set."""
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
                 "args": dict(vars(self.args))}
        meta = {"epoch": epoch_done, "arch": self.record["model"] or "", "metric": metric, "task": self.task.name}
        self.writer.commit(state, self.model.state_dict(),
                           self.ema.module.state_dict() if self.ema is not None else None, meta, best=better,
                           summary_csv=summary_csv, record=self.record)
