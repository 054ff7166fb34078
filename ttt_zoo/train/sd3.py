"""``ttt-zoo train --task sd3``: fine-tune SD3.5-T5 (or linearize a softmax SD3 / SD3.5 and fine-tune it).

The paper's recipe (arXiv 2605.02772 Table 9): AdamW, lr 1e-5, weight decay 1e-4, batch 64, 3,000 steps, constant
lr; the loss is SD3's rectified-flow loss with diffusers' ``compute_density_for_timestep_sampling`` (timestep
density) and ``compute_loss_weighting_for_sd3`` (loss weights):

    sigma ~ density;  x_t = (1 - sigma) x_0 + sigma * noise;
    loss = mean(w(sigma) * (v_theta(x_t, t, c) - (noise - x_0))^2)

Optional: ``--distill-weight L`` adds ``L * mean(w * (v_theta - v_teacher)^2)`` with the softmax source as teacher
(the paper uses none); EMA (``--model-ema``), gradient checkpointing (``--grad-checkpointing``).

Data (``--data-dir``): an image folder with captions, either ``metadata.jsonl`` (one JSON object per line with
``"file_name"`` and ``"text"``, the Hugging Face ``imagefolder`` convention) or, per image, a ``.txt`` file of the same
stem.  ``--cache-text-embeddings`` encodes every caption once and frees the three text encoders;
``--cache-latents`` encodes every image once with the VAE.  Components come from a local diffusers folder
(``--sd3-pipeline``).  Evaluation (``--eval-data-dir``, default the training folder) uses fixed noise and timesteps
per image and reports the flow loss and, with a teacher, the MSE of the prediction to the teacher's.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .distributed import all_reduce_sum
from .task import Task
from ttt_zoo.flags import Range

__all__ = ["SD3Task", "CaptionedImageFolder", "read_captions", "flow_matching_inputs"]

_logger = logging.getLogger("ttt_zoo.train")
IMG_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def read_captions(root: str) -> List[Tuple[str, str]]:
    """``[(image path, caption)]`` from ``metadata.jsonl`` (``file_name``, ``text``) or ``<stem>.txt`` files."""
    if not os.path.isdir(root):
        raise ValueError(f"--data-dir {root!r} is not a folder of images with captions.")
    meta = os.path.join(root, "metadata.jsonl")
    out = []
    if os.path.isfile(meta):
        with open(meta) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    path, text = os.path.join(root, row["file_name"]), row["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{meta}:{n}: need a JSON object with \"file_name\" and \"text\" ({e}).") from e
                if not os.path.isfile(path):
                    raise ValueError(f"{meta}:{n}: image {row['file_name']!r} not found in {root}.")
                out.append((path, str(text)))
    else:
        for name in sorted(os.listdir(root)):
            stem, ext = os.path.splitext(name)
            if ext.lower() in IMG_EXTS:
                txt = os.path.join(root, stem + ".txt")
                if not os.path.isfile(txt):
                    raise ValueError(f"{os.path.join(root, name)} has no caption: add {stem}.txt or a "
                                     f"metadata.jsonl (file_name, text) to {root}.")
                with open(txt) as f:
                    out.append((os.path.join(root, name), f.read().strip()))
    if not out:
        raise ValueError(f"No captioned images in {root} (metadata.jsonl or image + .txt pairs).")
    return out


class CaptionedImageFolder(Dataset):
    """``(pixels in [-1, 1] (3, S, S), index)``; the caption is ``captions[index]``."""

    def __init__(self, root: str, size: int, hflip: bool = False):
        from torchvision import transforms as T
        self.items = read_captions(root)
        self.captions = [c for _, c in self.items]
        self.transform = T.Compose([T.Resize(size), T.CenterCrop(size)] + ([T.RandomHorizontalFlip()] if hflip else [])
                                   + [T.ToTensor(), T.Normalize([0.5], [0.5])])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from PIL import Image
        with Image.open(self.items[i][0]) as im:
            return self.transform(im.convert("RGB")), i


def flow_matching_inputs(latents: torch.Tensor, scheduler, args, generator: Optional[torch.Generator] = None):
    """``(noisy, timesteps, target, weighting)`` of the rectified-flow loss (diffusers' SD3 density and weights)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
    b = latents.shape[0]
    u = compute_density_for_timestep_sampling(args.weighting_scheme, b, args.logit_mean, args.logit_std,
                                              args.mode_scale, generator=generator)
    n = scheduler.config.num_train_timesteps
    idx = (u * n).long().clamp(0, n - 1)
    timesteps = scheduler.timesteps[idx].to(latents.device)
    sigmas = scheduler.sigmas[idx].to(device=latents.device, dtype=latents.dtype).view(b, 1, 1, 1)
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype).to(latents.device)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    weighting = compute_loss_weighting_for_sd3(args.weighting_scheme, sigmas)
    return noisy, timesteps, noise - latents, weighting


class SD3Task(Task):
    name = "sd3"
    eval_metric = "loss"
    eval_mode = "min"

    def __init__(self, args, dist):
        super().__init__(args, dist)
        if not args.sd3_pipeline:
            raise ValueError("--task sd3 needs --sd3-pipeline DIR (a local diffusers SD3 / SD3.5 pipeline folder).")
        if not args.data_dir:
            raise ValueError("--task sd3 needs --data-dir DIR (images with captions; see docs/sd3.md).")
        if args.hflip and args.cache_latents:
            raise ValueError("--hflip has no effect with --cache-latents (each image is encoded once); drop one.")
        self.device = dist.device
        self.teacher: Optional[nn.Module] = None
        self.new_names: List[str] = []
        self._embeds: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._latents: Dict[Tuple[str, int], torch.Tensor] = {}

    # ----- components ---------------------------------------------------------------------------------------------
    def _load_components(self) -> None:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
        root = self.args.sd3_pipeline
        if not os.path.isfile(os.path.join(root, "model_index.json")):
            raise ValueError(f"--sd3-pipeline {root} is not a diffusers pipeline folder (no model_index.json).")
        self.vae = AutoencoderKL.from_pretrained(root, subfolder="vae").to(self.device).eval().requires_grad_(False)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")
        # the text side of the pipeline (no transformer, no VAE): encode_prompt
        self.text_pipe = StableDiffusion3Pipeline.from_pretrained(root, transformer=None, vae=None).to(self.device)
        for m in (self.text_pipe.text_encoder, self.text_pipe.text_encoder_2, self.text_pipe.text_encoder_3):
            if m is not None:
                m.eval().requires_grad_(False)

    def build_model(self) -> nn.Module:
        from diffusers import SD3Transformer2DModel
        from ttt_zoo.linearize import linearize
        from ttt_zoo.sd3 import SD3T5Transformer2DModel
        a = self.args
        self._load_components()
        cls = json.load(open(os.path.join(a.sd3_pipeline, "transformer", "config.json")))["_class_name"]
        if cls == "SD3T5Transformer2DModel" and a.softmax:
            raise ValueError("--softmax fine-tunes a softmax SD3 transformer, but --sd3-pipeline holds SD3.5-T5.")
        if cls == "SD3T5Transformer2DModel":
            model = SD3T5Transformer2DModel.from_pretrained(a.sd3_pipeline, subfolder="transformer")
            self.new_names = model.new_parameter_names()
            teacher = SD3Transformer2DModel.from_pretrained(a.teacher) if a.teacher else None
        elif a.softmax:
            model = SD3Transformer2DModel.from_pretrained(a.sd3_pipeline, subfolder="transformer")
            # the trainer's --grad-checkpointing calls timm's spelling
            model.set_grad_checkpointing = lambda enable=True: (
                model.enable_gradient_checkpointing if enable else model.disable_gradient_checkpointing)()
            teacher = SD3Transformer2DModel.from_pretrained(a.teacher or a.sd3_pipeline,
                                                            subfolder=None if a.teacher else "transformer")
        else:
            source = SD3Transformer2DModel.from_pretrained(a.sd3_pipeline, subfolder="transformer")
            model, self.new_names = linearize(
                source, ttt_dual_layers=a.ttt_dual_layers, ttt_joint_layers=a.ttt_joint_layers,
                ttt_key_norm_span=a.ttt_key_norm_span, ttt_rms_qk_norm=a.ttt_rms_qk_norm)
            teacher = SD3Transformer2DModel.from_pretrained(a.teacher) if a.teacher else source
        if a.initial_checkpoint:
            from ttt_zoo.checkpoint import load_checkpoint_file, unwrap_checkpoint
            missing, unexpected = model.load_state_dict(unwrap_checkpoint(load_checkpoint_file(a.initial_checkpoint)),
                                                        strict=False)
            if missing or unexpected:
                raise ValueError(f"--initial-checkpoint {a.initial_checkpoint} does not fit this SD3.5-T5 layout: "
                                 f"missing {missing[:4]}, unexpected {unexpected[:4]}.")
        if a.distill_weight > 0 and teacher is None:
            raise ValueError("--distill-weight needs a softmax teacher: --teacher DIR (a softmax SD3 transformer).")
        if teacher is not None:
            self.teacher = teacher.to(self.device).eval().requires_grad_(False)
        return model

    def param_groups(self, model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
        from ttt_zoo.linearize import LR_SCALES, sd3_param_groups
        lr_scale = LR_SCALES["sd3"] if self.args.ttt_lr_scale is None else self.args.ttt_lr_scale
        return sd3_param_groups(model, self.new_names, lr_scale=lr_scale, weight_decay=weight_decay)

    # ----- data ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode_text(self, captions: List[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        missing = sorted({c for c in captions if c not in self._embeds})
        if missing:
            if self.text_pipe is None:
                raise RuntimeError("the text encoders were freed by --cache-text-embeddings but a caption is new")
            emb, _, pooled, _ = self.text_pipe.encode_prompt(missing, missing, missing, device=self.device,
                                                             do_classifier_free_guidance=False,
                                                             max_sequence_length=self.args.max_sequence_length)
            fresh = {c: (e, p) for c, e, p in zip(missing, emb, pooled)}
            if not self.args.cache_text_embeddings:
                return self._stack(captions, fresh)
            self._embeds.update(fresh)
        return self._stack(captions, self._embeds)

    @staticmethod
    def _stack(captions, table):
        return torch.stack([table[c][0] for c in captions]), torch.stack([table[c][1] for c in captions])

    @torch.no_grad()
    def _encode_images(self, pixels: torch.Tensor, sample: bool = True) -> torch.Tensor:
        """VAE latents, scaled as SD3 expects; ``sample=False``: the posterior mean (evaluation is deterministic)."""
        cfg = self.vae.config
        dist = self.vae.encode(pixels.to(self.device, self.vae.dtype)).latent_dist
        lat = dist.sample() if sample else dist.mode()
        return (lat - (cfg.shift_factor or 0.0)) * cfg.scaling_factor

    def build_loaders(self) -> Tuple[Iterable, Optional[Iterable]]:
        a, d = self.args, self.dist
        size = a.img_size or 1024
        train_ds = CaptionedImageFolder(a.data_dir, size, hflip=a.hflip)
        eval_ds = CaptionedImageFolder(a.eval_data_dir or a.data_dir, size)
        self.captions = {"train": train_ds.captions, "eval": eval_ds.captions}
        if a.cache_text_embeddings:
            for caps in self.captions.values():
                for i in range(0, len(caps), 16):
                    self._encode_text(caps[i:i + 16] + ([""] if a.caption_dropout > 0 else []))
            self.text_pipe = None  # frees the text encoders
            _logger.info(f"cached {len(self._embeds)} caption embeddings; text encoders freed")
        if a.cache_latents:
            for split, ds in (("train", train_ds), ("eval", eval_ds)):
                for i in range(len(ds)):
                    self._latents[(split, i)] = self._encode_images(ds[i][0][None], sample=split == "train")[0]
        sampler = DistributedSampler(train_ds, num_replicas=d.world_size, rank=d.rank, shuffle=True,
                                     seed=a.seed) if d.world_size > 1 else None
        train = DataLoader(train_ds, batch_size=a.batch_size, shuffle=sampler is None, sampler=sampler,
                           num_workers=a.workers, drop_last=len(train_ds) >= a.batch_size * d.world_size,
                           pin_memory=a.pin_mem)
        eval_idx = list(range(d.rank, len(eval_ds), d.world_size))  # disjoint parts per rank
        eval_loader = DataLoader(torch.utils.data.Subset(eval_ds, eval_idx), batch_size=a.validation_batch_size or
                                 a.batch_size, shuffle=False, num_workers=a.workers)
        return train, eval_loader

    def batch_size(self, batch: Any) -> int:
        return len(batch[1])

    def _prepare(self, batch, split: str, generator: Optional[torch.Generator] = None):
        pixels, idx = batch
        idx = idx.tolist()
        if self.args.cache_latents:
            latents = torch.stack([self._latents[(split, i)] for i in idx])
        else:
            latents = self._encode_images(pixels, sample=split == "train")
        caps = [self.captions[split][i] for i in idx]
        if split == "train" and self.args.caption_dropout > 0:
            drop = torch.rand(len(caps), generator=generator) < self.args.caption_dropout
            caps = ["" if dr else c for c, dr in zip(caps, drop.tolist())]
        emb, pooled = self._encode_text(caps)
        return latents, emb, pooled

    # ----- loss ---------------------------------------------------------------------------------------------------
    def _losses(self, model, latents, emb, pooled, ids: Optional[List[int]] = None, teacher: bool = False):
        """Per-sample weighted flow loss (+ distillation / teacher MSE).  ``ids``: fixed noise and timestep per
        image (evaluation), else fresh random ones."""
        if ids is None:
            noisy, t, target, w = flow_matching_inputs(latents, self.scheduler, self.args)
        else:
            parts = [flow_matching_inputs(latents[j:j + 1], self.scheduler, self.args,
                                          torch.Generator().manual_seed(1000 + i)) for j, i in enumerate(ids)]
            noisy, t, target, w = (torch.cat(x) for x in zip(*parts))
        pred = model(hidden_states=noisy, encoder_hidden_states=emb, pooled_projections=pooled, timestep=t,
                     return_dict=False)[0]
        per = lambda x: (w.float() * x.float() ** 2).flatten(1).mean(1)  # noqa: E731 - per-sample weighted MSE
        out = {"flow": per(pred - target)}
        if teacher and self.teacher is not None:
            with torch.no_grad():
                ref = self.teacher(hidden_states=noisy, encoder_hidden_states=emb, pooled_projections=pooled,
                                   timestep=t, return_dict=False)[0]
            out["distill"] = per(pred - ref)
            out["mse_teacher"] = (pred.detach().float() - ref.float()).square().flatten(1).mean(1)
        return out

    def train_step(self, model: nn.Module, batch: Any) -> Tuple[torch.Tensor, Dict[str, float]]:
        latents, emb, pooled = self._prepare(batch, "train")
        parts = self._losses(model, latents, emb, pooled, teacher=self.args.distill_weight > 0)
        loss = parts["flow"].mean()
        extras = {"flow": loss.item()}
        if "distill" in parts:
            loss = loss + self.args.distill_weight * parts["distill"].mean()
            extras["distill"] = parts["distill"].mean().item()
        return loss, extras

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable) -> Dict[str, float]:
        """Flow loss and MSE to the teacher's prediction, with fixed noise / timestep per image (comparable across
        epochs and runs)."""
        flow = mse = n = 0.0
        for batch in loader:
            latents, emb, pooled = self._prepare(batch, "eval")
            parts = self._losses(model, latents, emb, pooled, ids=batch[1].tolist(), teacher=True)
            flow += parts["flow"].sum().item()
            mse += parts["mse_teacher"].sum().item() if "mse_teacher" in parts else 0.0
            n += len(batch[1])
        flow, mse, n = all_reduce_sum([flow, mse, n], self.device)
        out = {"loss": flow / max(n, 1)}
        if self.teacher is not None:
            out["mse_teacher"] = mse / max(n, 1)
        return out
