"""Building a run: its folder (through :class:`~ttt_zoo.run_folder.RunWriter`), model, optimizer, precision, data,
schedule and record, and loading the state a ``--resume`` continues from.  A mixin of
:class:`~ttt_zoo.train.trainer.Trainer`; every step fits on a screen."""
from __future__ import annotations

import math
import os
import sys
from datetime import datetime
from typing import Any, Dict, Optional

import torch
from torch import nn

from ttt_zoo import run_folder
from ttt_zoo.torchcompile import compile_model

from . import run_state
from .distributed import DistInfo, broadcast_object, init_distributed, lay_out_as_gradients
from .reporting import Summary, setup_logging
from .run_args import SAME_ON_RESUME, check_flags, flag_name, resolve_lr, usage

__all__ = ["Building"]


def _first_error(fn) -> Optional[str]:
    try:
        fn()
    except (OSError, ValueError) as e:
        return str(e)
    return None


def raise_everywhere(err: Optional[str], dist: DistInfo) -> None:
    """Rank 0 checked something; every rank raises its error (no rank is left waiting in a collective)."""
    err = broadcast_object(err) if dist.distributed else err
    if err:
        raise SystemExit(f"ttt-zoo train: error: {err}")


class Building:
    """The ``setup()`` of a :class:`~ttt_zoo.train.trainer.Trainer`."""

    def setup(self) -> None:
        a = self.args
        self.dist = d = init_distributed(a.device)
        from timm.utils import random_seed
        random_seed(a.seed, d.rank)
        check_flags(a)
        resolve_lr(a, d.world_size)
        if not math.isfinite(a.lr):
            raise usage(f"--lr {a.lr}: not a finite number; give a finite --lr, e.g. --lr 0.001")
        if getattr(a, "data_dir", None) and not getattr(a, "dataset", ""):  # recorded as an absolute real path
            a.data_dir = os.path.realpath(a.data_dir)
        if getattr(a, "initial_checkpoint", None):  # checked against its run's manifest (a run folder: its weights)
            a.initial_checkpoint = run_folder.resolve_checkpoint(a.initial_checkpoint, "--initial-checkpoint").weights
        self.folder = self._open_folder()
        if d.is_primary and not self.resume_file:  # the first file: what `--resume` restarts from after a kill
            self._write_args(run_folder.ARGS)
        self.log = setup_logging(os.path.join(self.folder, run_folder.LOG), d.is_primary)
        self.task = self.task_cls(a, d)
        self.eval_metric = a.eval_metric or self.task.eval_metric
        self._build_model()
        self._build_optimizer()
        self._build_data_and_schedule()
        self.start_epoch, self.num_updates = 0, 0
        self.best_metric, self.best_epoch = None, None
        self.summary = Summary(os.path.join(self.folder, run_folder.SUMMARY))
        if self.resume_file:
            self._resume(self.resume_file)
        need = 4 * run_state.estimate_checkpoint_bytes(self.model, ema=self.ema is not None)
        raise_everywhere(_first_error(lambda: run_state.check_output_dir(self.folder, need))
                         if d.is_primary else None, d)
        if d.is_primary and self.resume_file:
            self._write_args(run_folder.resume_args_name(self.start_epoch))
        self._log_setup()

    # ----- the folder -----
    def _open_folder(self) -> str:
        """Rank 0 creates (or, with --resume, reopens and recovers) the run folder and holds its lock; every rank
        gets its path and the state file to resume (None: start from the beginning)."""
        a, d = self.args, self.dist
        if a.resume:
            resume, err = None, None
            if d.is_primary:
                try:
                    resume = self.writer.reopen(a.resume)
                except (OSError, ValueError) as e:
                    err = str(e)
            raise_everywhere(err, d)
            self.resume_file = broadcast_object(resume) if d.distributed else resume
            folder = run_folder.resolve_resume(a.resume)[0]
            if resume is None and d.is_primary:
                print(f"{folder}: no epoch was committed; the run starts again from its {run_folder.ARGS}",
                      file=sys.stderr)
            return folder
        self.resume_file = None
        run_folder.refuse_run_output(a.output, "--output")  # a new run never lies inside another run's folder
        name = a.experiment or "-".join([datetime.now().strftime("%Y%m%d-%H%M%S"),
                                         (a.model or getattr(a, "linearize_from", "") or a.task).replace("/", "_"),
                                         str(a.img_size or "default")])
        folder = broadcast_object(os.path.abspath(os.path.join(a.output, name)))
        raise_everywhere(_first_error(lambda: self.writer.create(folder, a.output)) if d.is_primary else None, d)
        return folder

    def _write_args(self, name: str) -> None:
        self.writer.write_args(name, dict(vars(self.args), world_size=self.dist.world_size))

    # ----- model, optimizer, precision -----
    def _build_model(self) -> None:
        a, d = self.args, self.dist
        model = self.task.build_model().to(d.device)
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
        if d.distributed:
            lay_out_as_gradients(model)  # before the EMA copy, the optimizer and DDP's buckets
        self.model = model

    def _build_optimizer(self) -> None:
        a, d, model = self.args, self.dist, self.model
        from timm.optim import create_optimizer_v2
        groups = self.task.param_groups(model, a.weight_decay)
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
        self.ema = self.task.build_ema(model)
        self.train_model = model
        if d.distributed:
            from torch.nn.parallel import DistributedDataParallel
            self.train_model = DistributedDataParallel(
                model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
        # as timm's train.py: compiled after DDP; self.model (EMA, clipping, checkpoints, evaluation) stays uncompiled
        self.train_model = compile_model(self.train_model, getattr(a, "torchcompile", None),
                                         getattr(a, "torchcompile_mode", None))

    def _build_data_and_schedule(self) -> None:
        """The loaders, then timm's scheduler built for ``--epochs`` (also on resume: see :meth:`_resume`)."""
        a = self.args
        self.train_loader, self.eval_loader = self.task.build_loaders()
        self.updates_per_epoch = math.ceil(len(self.train_loader) / a.grad_accum_steps)
        from timm.scheduler import create_scheduler_v2, scheduler_kwargs
        a.sched_on_updates = not a.sched_on_epochs
        self.scheduler, self.num_epochs = create_scheduler_v2(
            self.optimizer, **scheduler_kwargs(a, decreasing_metric=self.task.eval_mode == "min"),
            updates_per_epoch=self.updates_per_epoch)

    def _log_setup(self) -> None:
        a, d, model = self.args, self.dist, self.model
        n_params = sum(p.numel() for p in model.parameters())
        self.log.info(f"{type(model).__name__}: {n_params / 1e6:.3f}M params; {d.world_size} process(es) on "
                      f"{d.device.type}; lr {a.lr:g}; {self.updates_per_epoch} updates/epoch; "
                      f"{len(self.optimizer.param_groups)} param groups "
                      f"(lr_scale {sorted({g.get('lr_scale', 1.0) for g in self.optimizer.param_groups})}); "
                      f"output {self.folder}")

    # ----- the record -----
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
        """Other data on resume: refused when its classes differ from the run's, else said (and recorded)."""
        if not old.get("data_dir") or old["data_dir"] == new["data_dir"]:
            return
        if old.get("class_names") is not None and old["class_names"] != new["class_names"]:
            theirs, ours = old["class_names"], new["class_names"] or []
            diff = sorted(set(theirs) ^ set(ours)) or ["the same names in another order"]
            raise usage(f"--resume {self.folder} --data-dir {new['data_dir']}: its classes differ from the run's "
                        f"(data {old['data_dir']}; differing: {', '.join(map(str, diff[:8]))}); resume on the run's "
                        f"own data (leave out --data-dir), or start a new run with --initial-checkpoint")
        if self.dist.is_primary:
            same = (f"the same {len(new['class_names'])} classes as" if new["class_names"] is not None
                    else "no class names to compare with")
            print(f"--data-dir {new['data_dir']}: {same} the run's data {old['data_dir']}; training continues on it "
                  f"(recorded in {run_folder.RECORD})", file=sys.stderr)

    # ----- resume -----
    def _resume(self, path: str) -> None:
        d = self.dist
        s = run_state.load_state(path)
        saved = s.get("args") or {}
        for k in SAME_ON_RESUME:  # also when args.yaml is missing
            if k in saved and hasattr(self.args, k) and saved[k] != getattr(self.args, k):
                raise usage(f"--resume {path}: {flag_name(k)} {getattr(self.args, k)!r} differs from the run's "
                            f"{saved[k]!r}; resume with the run's own {flag_name(k)}, or start a new run with "
                            f"--initial-checkpoint")
        self._load_model_state(path, s)
        self._load_optimizer_state(path, s)
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

    def _load_model_state(self, path: str, s: Dict[str, Any]) -> None:
        try:
            self.model.load_state_dict(s["model"])
        except RuntimeError as e:
            first = str(e).split("\n\t")[1:2] or [str(e)[:200]]
            raise usage(f"--resume {path}: the checkpoint does not fit the model built from these flags "
                        f"({first[0].strip()}); resume with the run's own --model / --model-kwargs / "
                        f"--num-classes / --img-size") from None
        if self.ema is not None:
            if s.get("ema") is None:
                raise SystemExit(f"ttt-zoo train: error: {path} has no EMA state; resume without --model-ema.")
            self.ema.load_state_dict(s["ema"])

    def _load_optimizer_state(self, path: str, s: Dict[str, Any]) -> None:
        a = self.args
        try:
            self.optimizer.load_state_dict(s["optimizer"])
        except ValueError as e:
            raise usage(f"--resume {path}: the optimizer state does not fit ({e}); resume with the run's own "
                        f"--opt / --layer-decay / --weight-decay") from None
        old_keys = {k for g in s["optimizer"].get("param_groups", []) for k in g}
        new_keys = {k for g in self.optimizer.param_groups for k in g}
        if old_keys and old_keys != new_keys:
            raise usage(f"--resume {path}: the run's optimizer differs from --opt {a.opt} (its settings "
                        f"{sorted(old_keys ^ new_keys)} differ); resume with the run's own --opt")

    def _say_changes(self, saved: Dict[str, Any]) -> None:
        a = self.args
        for k in ("epochs", "lr", "data_dir"):
            if k in saved and saved[k] != getattr(a, k, None):
                self.log.info(f"resume: {flag_name(k)} {saved[k]} -> {getattr(a, k)} from epoch {self.start_epoch} "
                              f"(recorded in {run_folder.resume_args_name(self.start_epoch)})")
