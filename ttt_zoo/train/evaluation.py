"""Evaluating the model (and its EMA) after an epoch, and whether the result is the run's best.  A mixin of
:class:`~ttt_zoo.train.trainer.Trainer`."""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .run_args import usage

__all__ = ["Evaluation"]


class Evaluation:
    def _evaluate(self, epoch: int) -> Dict[str, float]:
        """The task's metrics of the model and, with --model-ema, of its EMA (keys ``ema_*``); never a NaN."""
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
        bad = {k: v for k, v in out.items() if not math.isfinite(v)}
        if bad:
            raise usage(f"epoch {epoch}: evaluation gave non-finite {bad}; nothing of this epoch was saved and "
                        f"best.* is unchanged; lower --lr, add --clip-grad 1.0, or check --amp")
        return out

    def _is_better(self, metric: Optional[float]) -> bool:
        if metric is None or not math.isfinite(metric):
            return False
        if self.best_metric is None:
            return True
        return metric > self.best_metric if self.task.eval_mode == "max" else metric < self.best_metric
