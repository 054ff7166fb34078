"""The tasks of ``ttt-zoo train`` by name, and each task's own flags.

Imports no torch: ``ttt-zoo train --help`` builds the trainer's parser from here before ``ttt_zoo/__init__`` runs
(``_ttt_zoo_cli``).  The task classes (:data:`TASKS`, imported on use by ``task.get_task_class``) read these flags.
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict

from ttt_zoo.flags import CROP_PCT, MAX_SEED, MEAN, STD, Range

__all__ = ["TASKS", "add_task_args", "add_dataset_args"]

#: ``--task`` name -> ``module:Class``
TASKS: Dict[str, str] = {
    "classification": "ttt_zoo.train.classification:ClassificationTask",
    "diffusion": "ttt_zoo.train.diffusion:DiffusionTask",
    "sd3": "ttt_zoo.train.sd3:SD3Task",
}


def add_task_args(parser: argparse.ArgumentParser, task: str) -> None:
    """Add task ``task``'s own flags (the Trainer's shared ones are in ``train.args``)."""
    if task not in _TASK_FLAGS:
        raise ValueError(f"Unknown --task {task!r}; choose one of {sorted(TASKS)}.")
    _TASK_FLAGS[task](parser)


def add_dataset_args(group) -> None:
    """The data-set flags every image-folder task shares (timm train.py's spellings)."""
    group.add_argument("--dataset", default="", help="timm dataset name ('' = image folder at --data-dir)")
    group.add_argument("--train-split", default="train")
    group.add_argument("--val-split", default="validation", help="('' = no evaluation)")


def _image_folder_args(parser, title: str, data_args: Callable, family: str, source: str, lr_scale: str) -> None:
    """An image-folder task's flags: the data set, the task's data flags, ``--linearize-from`` into ``family``."""
    g = parser.add_argument_group(title)
    add_dataset_args(g)
    data_args(g)
    g = parser.add_argument_group(f"linearize ({family})")
    g.add_argument("--linearize-from", default="", metavar="MODEL",
                   help=f"{source} to linearize into {family} before training (needs --pretrained or "
                        "--initial-checkpoint)")
    g.add_argument("--ttt-lr-scale", type=Range(float, gt=0, le=1000), default=None,
                   help=f"lr multiplier (lr_scale) of the new TTT parameters (default: {lr_scale})")


def _classification_data(g) -> None:
    g.add_argument("--crop-pct", type=CROP_PCT, default=None)
    g.add_argument("--interpolation", default="", help="eval resize interpolation")
    g.add_argument("--mean", type=MEAN, nargs="+", default=None)
    g.add_argument("--std", type=STD, nargs="+", default=None)
    g.add_argument("--no-aug", action="store_true", help="no training augmentation (resize + crop only)")
    g.add_argument("--scale", type=Range(float, gt=0, le=1), nargs=2, default=[0.08, 1.0])
    g.add_argument("--ratio", type=Range(float, gt=0, le=100), nargs=2, default=[3.0 / 4.0, 4.0 / 3.0])
    g.add_argument("--hflip", type=Range(float, ge=0, le=1), default=0.5)
    g.add_argument("--vflip", type=Range(float, ge=0, le=1), default=0.0)
    g.add_argument("--color-jitter", type=Range(float, ge=0, le=10), default=0.4)
    g.add_argument("--aa", default=None, help="timm auto-augment policy, e.g. rand-m9-mstd0.5-inc1")
    g.add_argument("--reprob", type=Range(float, ge=0, le=1), default=0.0, help="random erasing probability")
    g.add_argument("--remode", default="pixel")
    g.add_argument("--recount", type=Range(int, ge=1, le=100), default=1)
    g.add_argument("--train-interpolation", default="random")
    g.add_argument("--smoothing", type=Range(float, ge=0, lt=1), default=0.1, help="label smoothing")
    g.add_argument("--mixup", type=Range(float, ge=0, le=100), default=0.0, help="mixup alpha (on when > 0)")
    g.add_argument("--cutmix", type=Range(float, ge=0, le=100), default=0.0, help="cutmix alpha (on when > 0)")
    g.add_argument("--cutmix-minmax", type=Range(float, gt=0, le=1), nargs=2, default=None)
    g.add_argument("--mixup-prob", type=Range(float, ge=0, le=1), default=1.0)
    g.add_argument("--mixup-switch-prob", type=Range(float, ge=0, le=1), default=0.5)
    g.add_argument("--mixup-mode", default="batch", choices=("batch", "pair", "elem"))
    g.add_argument("--no-eval", action="store_true",
                   help="no evaluation: no best checkpoint is picked (last.* only); for data without a "
                        "validation split, or give --val-split FRACTION")


def _diffusion_data(g) -> None:
    g.add_argument("--hflip", type=Range(float, ge=0, le=1), default=0.5,
                   help="horizontal flip probability of training images (DiT: 0.5; 0 for digits or text)")
    g.add_argument("--vae", default=None, metavar="DIR",
                   help="train on the latents of this local diffusers AutoencoderKL folder (default: pixels)")
    g.add_argument("--eval-seed", type=Range(int, ge=0, le=MAX_SEED), default=0,
                   help="seed of the eval loss's fixed timesteps and noise (the same every epoch)")


def _sd3_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(model="sd3_t5")  # names the experiment folder; the task builds the model
    g = parser.add_argument_group("SD3.5-T5 (--task sd3)")
    g.add_argument("--sd3-pipeline", default=None, metavar="DIR",
                   help="local diffusers StableDiffusion3Pipeline folder (softmax: linearized here; SD3.5-T5: "
                        "fine-tuned as is)")
    g.add_argument("--teacher", default=None, metavar="DIR",
                   help="softmax SD3 transformer folder for --distill-weight / the teacher MSE (default: the "
                        "--sd3-pipeline transformer when it is softmax)")
    g.add_argument("--ttt-dual-layers", type=Range(int, ge=0, le=1000), nargs="*", default=None,
                   help="default: the paper's layout")
    g.add_argument("--ttt-joint-layers", type=Range(int, ge=0, le=1000), nargs="*", default=None,
                   help="default: the paper's layout")
    g.add_argument("--ttt-key-norm-span", default="joint", choices=("joint", "separate"))
    g.add_argument("--ttt-rms-qk-norm", default="keep", choices=("keep", "skip"))
    g.add_argument("--softmax", action="store_true",
                   help="fine-tune the softmax transformer itself (the paper's SD3.5-FT baseline)")
    g.add_argument("--ttt-lr-scale", type=Range(float, gt=0, le=1000), default=None,
                   help="lr multiplier of the new TTT parameters (default: ttt_zoo.linearize.LR_SCALES['sd3'], 1: "
                        "the paper's SD3 recipe states none)")
    g.add_argument("--eval-data-dir", default=None, metavar="DIR", help="default: --data-dir")
    g.add_argument("--max-sequence-length", type=Range(int, ge=1, le=4096), default=256,
                   help="T5 tokens per caption")
    g.add_argument("--cache-text-embeddings", action="store_true",
                   help="encode every caption once, then free the text encoders")
    g.add_argument("--cache-latents", action="store_true", help="encode every image once with the VAE")
    g.add_argument("--caption-dropout", type=Range(float, ge=0, le=1), default=0.0,
                   help="probability of the empty caption")
    g.add_argument("--hflip", action="store_true", help="random horizontal flips (not with --cache-latents)")
    g.add_argument("--weighting-scheme", default="logit_normal",
                   choices=("sigma_sqrt", "logit_normal", "mode", "cosmap", "none"))
    g.add_argument("--logit-mean", type=Range(float, ge=-10, le=10), default=0.0)
    g.add_argument("--logit-std", type=Range(float, gt=0, le=10), default=1.0)
    g.add_argument("--mode-scale", type=Range(float, ge=0, le=10), default=1.29)
    g.add_argument("--distill-weight", type=Range(float, ge=0, le=1000), default=0.0,
                   help="weight of the MSE to the softmax teacher's prediction (0: the paper's plain fine-tune)")


_TASK_FLAGS: Dict[str, Callable] = {
    "classification": lambda p: _image_folder_args(p, "classification data and augmentation (timm)",
                                                   _classification_data, "T5", "softmax ViT/DeiT", "the paper's 20x"),
    "diffusion": lambda p: _image_folder_args(p, "diffusion data (--task diffusion)", _diffusion_data, "DiT5",
                                              "softmax DiT (dit_*)",
                                              "the paper's 2x, ttt_zoo.linearize.LR_SCALES['dit']"),
    "sd3": _sd3_args,
}
