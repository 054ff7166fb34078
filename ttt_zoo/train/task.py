"""The :class:`Task` interface: what differs between classification, diffusion and SD3 training.

The :class:`~ttt_zoo.train.trainer.Trainer` owns everything else: output folder, args.yaml, summary.csv,
checkpoints (safetensors weights + a ``weights_only`` training state), resume, DDP wrapping and gradient averaging,
AMP / GradScaler, gradient accumulation, clipping, the optimizer (timm ``create_optimizer_v2`` on
:meth:`Task.param_groups`), the scheduler (timm ``create_scheduler_v2``, stepped per update, honouring each
group's ``lr_scale``), EMA updates, logging / tqdm, throughput and the plot.

A task is chosen with ``--task NAME``; :data:`TASKS` maps names to ``module:Class`` and is imported lazily, so
``--task classification`` never imports diffusers.

EMA adapter protocol (what :meth:`Task.build_ema` returns): ``.update(model, step: int)``, ``.module`` (an
``nn.Module`` to evaluate), ``.state_dict()``, ``.load_state_dict(sd)``.  timm's ``ModelEmaV3`` fits as is.
"""
from __future__ import annotations

import argparse
import importlib
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .distributed import DistInfo
from .task_flags import TASKS

__all__ = ["Task", "TASKS", "get_task_class"]



def get_task_class(name: str) -> type:
    """The Task class registered as ``name`` (imported on first use)."""
    if name not in TASKS:
        raise ValueError(f"Unknown --task {name!r}; choose one of {sorted(TASKS)}.")
    module, cls = TASKS[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ValueError(f"--task {name!r} is registered but {module} is not available in this installation.") from e
    return getattr(mod, cls)


class Task:
    """Base class; subclasses override the methods marked 'must'."""
    name: str = "classification"  # the value of --task
    eval_metric: str = "top1"     # key of evaluate()'s dict (summary.csv column eval_<key>) that picks the best checkpoint
    eval_mode: str = "max"        # "max" or "min" (diffusion: "min" on eval loss)

    def __init__(self, args: argparse.Namespace, dist: DistInfo):
        self.args = args
        self.dist = dist

    def build_model(self) -> nn.Module:
        """Must: the model to train, on CPU or ``self.dist.device``, before DDP wrapping (may linearize / load)."""
        raise NotImplementedError

    def param_groups(self, model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
        """Optimizer groups. Default: timm's decay / no-decay (``model.no_weight_decay()``) and, with
        ``--layer-decay``, layer-decay groups (``model.group_matcher()``). Groups may carry ``lr_scale``."""
        from ttt_zoo.linearize import param_groups
        return param_groups(model, (), multiplier=1.0, weight_decay=weight_decay,
                            layer_decay=getattr(self.args, "layer_decay", None))

    def build_loaders(self) -> Tuple[Iterable, Optional[Iterable]]:
        """Must: ``(train_loader, eval_loader_or_None)``. With ``dist.world_size > 1`` the train loader uses a
        ``DistributedSampler`` (seeded with ``--seed``; the Trainer calls ``set_epoch``) and each rank evaluates a
        disjoint part of the eval set."""
        raise NotImplementedError

    def train_step(self, model: nn.Module, batch: Any) -> Tuple[torch.Tensor, Dict[str, float]]:
        """Must: ``(loss, extras)``: the scalar loss averaged over the local batch, and floats to log.
        Runs under the Trainer's autocast; the Trainer does backward / step."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module, loader: Iterable) -> Dict[str, float]:
        """Must: metrics over the whole eval set: reduce local sums and counts over ranks with
        :func:`ttt_zoo.train.distributed.all_reduce_sum`. Keys become summary.csv columns ``eval_<key>``."""
        raise NotImplementedError

    def batch_size(self, batch: Any) -> int:
        """Number of samples (images) in a batch, for throughput. Default: ``len(batch[0])``."""
        return len(batch[0])

    def build_ema(self, model: nn.Module) -> Optional[Any]:
        """Default: timm ``ModelEmaV3`` when ``--model-ema`` (decay ``--model-ema-decay``, warmup
        ``--model-ema-warmup``); else None."""
        if not getattr(self.args, "model_ema", False):
            return None
        from timm.utils import ModelEmaV3
        return ModelEmaV3(model, decay=self.args.model_ema_decay, use_warmup=getattr(self.args, "model_ema_warmup",
                                                                                      False))

    def state_dict(self) -> Dict[str, Any]:
        """Task-owned state that exact resume needs (tensors / plain containers only)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

