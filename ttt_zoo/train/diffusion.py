"""``ttt-zoo train --task diffusion``: train or fine-tune DiT, DiT3, DiT5 (or a ``linearize``d DiT) on an image folder.

The objective is the official DiT one (facebookresearch/DiT ``train.py`` with ``create_diffusion``): 1000 steps,
linear betas 1e-4..0.02 (diffusers' ``DDPMScheduler`` from :func:`ttt_zoo.sampling.make_scheduler`), t uniform,
``x_t = add_noise(x0, eps, t)``, loss = MSE(eps) and, when the model has ``learn_sigma``, the variational-bound term
that trains the learned-range variance with the mean detached (KL to the true posterior in bits per dimension; the
discretized-Gaussian decoder NLL at t = 0, computed with the exact normal CDF).  Labels are dropped to the null class
with the model's ``class_dropout_prob`` inside its ``y_embedder``, as in DiT, for classifier-free guidance.

Data: ``--data-dir`` with ``train/`` and ``val/`` class folders (timm's folder reader), classes taken by name as in
classification (empty folders and stray files refused; ``val/`` may hold a subset; ``class_names`` in run.json).
Pixel space by default (``in_chans=3``, the model's ``input_size`` = ``--img-size``, images scaled to [-1, 1]);
``--vae DIR`` trains on the latents of a local diffusers ``AutoencoderKL``
(``input_size = img_size / 2**(levels - 1)``, ``scaling_factor`` and ``shift_factor`` from its config).
EMA: diffusers' ``EMAModel`` (decay ``--model-ema-decay``; diffusers' own ``(1 + n) / (10 + n)`` warmup below it,
whereas DiT's EMA is a constant 0.9999 from a copy of the initial weights).

Randomness: timesteps, noise, VAE posterior samples and label dropout of update ``n`` on rank ``r`` come from seeds
derived from ``(--seed, r, n)``; the counter ``n`` is :meth:`DiffusionTask.state_dict`, so a resumed run draws
exactly what an uninterrupted one would, on every rank.  Evaluation uses fixed seeds per batch, so ``eval_loss``
is comparable across epochs (lower is better).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from .classification import ImageFolderTask
from .distributed import DistInfo, all_reduce_sum
from ttt_zoo.flags import MAX_SEED, Range

__all__ = ["DiffusionTask", "DiTDiffusion", "DiffusersEMA", "build_dit", "load_vae", "dit_model_kwargs",
           "step_seed"]

_TRAIN, _EVAL = 0, 1  # seed streams


def step_seed(*keys: int) -> int:
    """A 64-bit seed from a tuple of integers (numpy's SeedSequence: well mixed, same on every platform)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0])


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


# ----- the DiT diffusion process -----

class DiTDiffusion:
    """The DiT training loss on a diffusers ``DDPMScheduler``: ``loss(model, x0, y, t, noise)``."""

    def __init__(self, learn_sigma: bool = True, num_train_timesteps: int = 1000):
        from ttt_zoo.sampling import make_scheduler
        self.scheduler = make_scheduler("ddpm", learn_sigma=learn_sigma, num_train_timesteps=num_train_timesteps)
        self.num_timesteps = num_train_timesteps
        self.learn_sigma = learn_sigma
        # posterior q(x_{t-1} | x_t, x_0) tables in float64 (the official code's numpy float64), looked up per batch
        betas = self.scheduler.betas.double()
        ab = torch.cumprod(1 - betas, 0)
        ab_prev = torch.cat([ab.new_ones(1), ab[:-1]])
        post_var = betas * (1 - ab_prev) / (1 - ab)
        self.tables = {
            "sqrt_recip_ab": (1 / ab).sqrt(), "sqrt_recipm1_ab": (1 / ab - 1).sqrt(),
            "coef_x0": betas * ab_prev.sqrt() / (1 - ab), "coef_xt": (1 - ab_prev) * (1 - betas).sqrt() / (1 - ab),
            "post_logvar": torch.cat([post_var[1:2], post_var[1:]]).log(),  # clipped: t=0 uses t=1's variance
            "log_betas": betas.log()}
        self._on_device: Dict[torch.device, Dict[str, torch.Tensor]] = {}

    def _at(self, name: str, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """Table values at ``t`` (float32), shaped to broadcast over (B, C, H, W)."""
        if t.device not in self._on_device:
            self._on_device[t.device] = {k: v.to(t.device) for k, v in self.tables.items()}
        return self._on_device[t.device][name][t].float().reshape(-1, *([1] * (ndim - 1)))

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.scheduler.add_noise(x0, noise, t)

    def loss(self, model: nn.Module, x0: torch.Tensor, y: torch.Tensor, t: torch.Tensor,
             noise: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Per-sample ``loss``, ``mse`` and (with ``learn_sigma``) ``vb``, each of shape (B,), in float32."""
        x_t = self.add_noise(x0, noise, t)
        out = model(x_t, t, y).float()
        c = x0.shape[1]
        dims = tuple(range(1, x0.ndim))
        eps = out[:, :c]
        terms = {"mse": (eps - noise.float()).pow(2).mean(dims)}
        if self.learn_sigma:
            if out.shape[1] != 2 * c:
                raise ValueError(f"a learn_sigma model must output {2 * c} channels, got {out.shape[1]}.")
            terms["vb"] = self.vb_bits(x0.float(), x_t.float(), t, eps.detach(), out[:, c:])
            terms["loss"] = terms["mse"] + terms["vb"]
        else:
            terms["loss"] = terms["mse"]
        return terms

    def vb_bits(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor,
                var_values: torch.Tensor) -> torch.Tensor:
        """The variational-bound term of ``t`` in bits per dimension for the learned-range variance."""
        at = lambda name: self._at(name, t, x0.ndim)  # noqa: E731
        pred_x0 = at("sqrt_recip_ab") * x_t - at("sqrt_recipm1_ab") * eps
        mean = at("coef_x0") * pred_x0 + at("coef_xt") * x_t
        true_mean = at("coef_x0") * x0 + at("coef_xt") * x_t
        frac = (var_values + 1) / 2
        logvar = frac * at("log_betas") + (1 - frac) * at("post_logvar")
        true_logvar = at("post_logvar")
        kl = 0.5 * (-1 + logvar - true_logvar + (true_logvar - logvar).exp()
                    + (true_mean - mean) ** 2 * (-logvar).exp())
        nll = -discretized_gaussian_log_likelihood(x0, mean, 0.5 * logvar)
        dims = tuple(range(1, x0.ndim))
        return torch.where(t == 0, nll.mean(dims), kl.mean(dims)) / math.log(2.0)


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """log P(x) of data in [-1, 1] quantised to 256 levels under N(mean, exp(log_scale)^2); the edge bins take
    the tails (the DDPM decoder)."""
    inv = torch.exp(-log_scale)
    upper = torch.special.ndtr(inv * (x - mean + 1 / 255))
    lower = torch.special.ndtr(inv * (x - mean - 1 / 255))
    tiny = 1e-12
    return torch.where(x < -0.999, upper.clamp_min(tiny).log(),
                       torch.where(x > 0.999, (1 - lower).clamp_min(tiny).log(), (upper - lower).clamp_min(tiny).log()))


# ----- EMA: diffusers' EMAModel behind the trainer's adapter protocol -----

class DiffusersEMA:
    """diffusers ``EMAModel`` whose shadow parameters ARE the parameters of ``.module`` (no second copy).

    ``update(model, step)`` runs ``EMAModel.step`` and copies buffers; the decay follows EMAModel's own
    ``optimization_step`` counter (it counts the same updates as the Trainer's ``step``, and is restored with it).
    ``state_dict`` / ``load_state_dict`` are EMAModel's (decay settings, counter, shadow parameters)."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, **ema_kwargs):
        from diffusers.training_utils import EMAModel
        self.module = copy.deepcopy(_unwrap(model)).eval().requires_grad_(False)
        self.ema = EMAModel(self.module.parameters(), decay=decay, **ema_kwargs)
        self._alias()

    def _alias(self) -> None:
        self.ema.shadow_params = [p.data for p in self.module.parameters()]

    @torch.no_grad()
    def update(self, model: nn.Module, step: Optional[int] = None) -> None:
        model = _unwrap(model)
        self.ema.step(model.parameters())
        for b_ema, b in zip(self.module.buffers(), model.buffers()):
            b_ema.copy_(b)

    def state_dict(self) -> Dict[str, Any]:
        return self.ema.state_dict()

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        own = list(self.module.parameters())
        shadow = state.get("shadow_params")
        if not isinstance(shadow, list) or len(shadow) != len(own) or any(
                s.shape != p.shape for s, p in zip(shadow, own)):
            raise ValueError(f"EMA state does not fit the model: {len(own)} parameters expected, the state holds "
                             f"{len(shadow) if isinstance(shadow, list) else 'no list of'} shadow parameters "
                             "(was it saved for another model or another --task?).")
        self.ema.load_state_dict(state)
        for p, s in zip(own, self.ema.shadow_params):
            p.copy_(s)
        self._alias()


# ----- model and VAE -----

def load_vae(path: str, device: Optional[torch.device] = None):
    """A local diffusers ``AutoencoderKL`` folder (never downloaded), frozen, in eval mode."""
    if not path or not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--vae {path!r} is not a diffusers AutoencoderKL folder (a folder with config.json "
                                "and the weights, e.g. a local copy of stabilityai/sd-vae-ft-ema).")
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(path, local_files_only=True)
    return vae.to(device or "cpu").eval().requires_grad_(False)


def vae_factor(vae) -> int:
    """Spatial downsampling of an AutoencoderKL (8 for the SD VAE)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def dit_model_kwargs(img_size: int, num_classes: int, vae=None) -> Dict[str, Any]:
    """The kwargs that fit a DiT to the data: pixel space (3 channels at ``img_size``) or the VAE's latents."""
    if vae is None:
        return dict(input_size=img_size, in_chans=3, num_classes=num_classes)
    f = vae_factor(vae)
    if img_size % f:
        raise ValueError(f"--img-size {img_size} is not divisible by the VAE's downsampling factor {f}.")
    return dict(input_size=img_size // f, in_chans=vae.config.latent_channels, num_classes=num_classes)


def build_dit(model_name: str, linearize_from: Optional[str] = None, pretrained: bool = False,
              checkpoint: Optional[str] = None, **kwargs) -> Tuple[nn.Module, List[str]]:
    """``timm.create_model`` of a DiT-family model, or of a softmax DiT ``linearize_from`` that is then linearized.

    ``checkpoint`` (any layout :mod:`ttt_zoo.checkpoint` reads; EMA weights preferred) is loaded before
    linearizing.  Returns ``(model, new_param_names)`` (the names are empty without ``linearize_from``)."""
    import timm
    import ttt_zoo  # noqa: F401 - registers the models
    from ttt_zoo.checkpoint import load_checkpoint_file
    from ttt_zoo.models.dit import DiT, checkpoint_filter_fn
    from ttt_zoo.registry import resolve_model_name
    name = linearize_from or model_name
    resolve_model_name(name, "diffusion", "--linearize-from" if linearize_from else "--model")
    model = timm.create_model(name, pretrained=pretrained, **kwargs)
    if not isinstance(model, DiT):
        raise ValueError(f"--task diffusion trains DiT-family models (dit_*, dit3_*, dit5_*); {name!r} is a "
                         f"{type(model).__name__}.")
    if checkpoint:
        model.load_state_dict(checkpoint_filter_fn(load_checkpoint_file(checkpoint), model))
    if not linearize_from:
        return model, []
    from ttt_zoo.linearize import linearize
    model, new = linearize(model)
    return model, list(new)


# ----- the task -----

class DiffusionTask(ImageFolderTask):
    """An image folder's classes are taken by name, as in classification (:meth:`ImageFolderTask._class_map`)."""
    name = "diffusion"
    eval_metric = "loss"
    eval_mode = "min"

    def __init__(self, args: argparse.Namespace, dist: DistInfo):
        super().__init__(args, dist)
        self.step = 0  # train_step calls so far: the whole RNG state of the task
        self.vae = load_vae(args.vae, dist.device) if getattr(args, "vae", None) else None
        self.diffusion: Optional[DiTDiffusion] = None

    # --- data ---
    def _img_size(self) -> int:
        size = getattr(self.args, "img_size", None)
        if not size:
            raise ValueError("--task diffusion needs --img-size (the training resolution in pixels).")
        return int(size)

    def _transform(self, train: bool):
        from torchvision import transforms as T
        size = self._img_size()
        flip = [T.RandomHorizontalFlip(self.args.hflip)] if train and getattr(self.args, "hflip", 0) > 0 else []
        return T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size), *flip,
                          T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])  # [-1, 1], as DiT

    def _datasets(self):
        if self._train_ds is None:
            from timm.data import create_dataset
            a = self.args
            self._require_data()
            class_map = self._class_map(a.val_split)
            ds = lambda split, train: create_dataset(a.dataset, root=a.data_dir, split=split,  # noqa: E731
                                                     is_training=train, transform=self._transform(train),
                                                     class_map=class_map)
            self._train_ds = ds(a.train_split, True)
            self._eval_ds = ds(a.val_split, False) if a.val_split else None
        return self._train_ds, self._eval_ds

    def _num_classes(self) -> int:
        n = self._checked_num_classes()
        if not n:
            raise ValueError("Cannot tell the number of classes from the data: give --num-classes.")
        return n

    def build_loaders(self) -> Tuple[Iterable, Optional[Iterable]]:
        return self._loaders(*self._datasets())

    # --- model ---
    def build_model(self) -> nn.Module:
        a = self.args
        if getattr(a, "drop_path", None) or getattr(a, "drop", 0):
            raise ValueError("DiT models have no dropout or drop path: leave --drop / --drop-path unset for "
                             "--task diffusion.")
        if a.linearize_from and a.model:
            raise ValueError("Give either --model (train it) or --linearize-from (linearize it into DiT5, then "
                             "train), not both.")
        if a.linearize_from and not (a.pretrained or a.initial_checkpoint):
            raise ValueError("--linearize-from needs the softmax DiT's weights: add --pretrained or "
                             "--initial-checkpoint PATH.")
        if not (a.model or a.linearize_from):
            raise ValueError("No model: give --model NAME (dit_*, dit3_*, dit5_*) or --linearize-from dit_*.")
        kwargs = dit_model_kwargs(self._img_size(), self._num_classes(), self.vae)
        kwargs.update(dict(a.model_kwargs or {}))
        from ttt_zoo.checkpoint import CheckpointError
        try:
            model, self.new_param_names = build_dit(a.model, linearize_from=a.linearize_from or None,
                                                    pretrained=bool(a.pretrained),
                                                    checkpoint=a.initial_checkpoint or None, **kwargs)
        except CheckpointError as e:
            raise ValueError(f"{e} The model was built for {kwargs['in_chans']} input channels at input_size "
                             f"{kwargs['input_size']} and {kwargs['num_classes']} classes (from --img-size, --vae and "
                             "the data): released DiT weights take 4-channel SD-VAE latents (--vae DIR, --img-size "
                             "256) and 1000 classes (--num-classes 1000).") from e
        self.diffusion = DiTDiffusion(learn_sigma=model.learn_sigma)
        return model

    def param_groups(self, model: nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
        from ttt_zoo.linearize import LR_SCALES, param_groups
        mult = (getattr(self.args, "ttt_lr_scale", None) or LR_SCALES["dit"]) if self.new_param_names else 1.0
        return param_groups(_unwrap(model), self.new_param_names, multiplier=mult, weight_decay=weight_decay,
                            layer_decay=getattr(self.args, "layer_decay", None))

    def build_ema(self, model: nn.Module) -> Optional[DiffusersEMA]:
        if not getattr(self.args, "model_ema", False):
            return None
        return DiffusersEMA(model, decay=float(self.args.model_ema_decay))

    # --- steps ---
    def _generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.dist.device)
        g.manual_seed(seed)
        return g

    @torch.no_grad()
    def _encode(self, images: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if self.vae is None:
            return images
        with torch.autocast(images.device.type, enabled=False):
            posterior = self.vae.encode(images.to(self.vae.dtype)).latent_dist
            z = posterior.sample(generator=g).float()
        shift = getattr(self.vae.config, "shift_factor", None) or 0.0
        return (z - shift) * self.vae.config.scaling_factor

    def _draw(self, x: torch.Tensor, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, self.diffusion.num_timesteps, (x.shape[0],), device=x.device, generator=g)
        noise = torch.randn(x.shape, device=x.device, dtype=x.dtype, generator=g)
        return t, noise

    def _to_device(self, batch) -> Tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch[0], batch[1]
        return (images.to(self.dist.device, non_blocking=True).float(),
                labels.to(self.dist.device, non_blocking=True).long())

    def train_step(self, model: nn.Module, batch: Any) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """DiT loss of one batch; extras ``mse`` / ``vb`` are 0-dim tensors (read only when logged: no sync)."""
        images, y = self._to_device(batch)
        seed = step_seed(self.args.seed, _TRAIN, self.dist.rank, self.step)
        g = self._generator(seed)
        x0 = self._encode(images, g)
        t, noise = self._draw(x0, g)
        cuda = [self.dist.device] if self.dist.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            # the model's label dropout (torch.rand in its y_embedder) uses the global RNG: seed it from the step
            if cuda:
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            terms = self.diffusion.loss(model, x0, y, t, noise)
        self.step += 1
        extras = {k: v.detach().mean() for k, v in terms.items() if k != "loss"}
        return terms["loss"].mean(), extras

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Iterable) -> Dict[str, float]:
        """Mean ``loss`` / ``mse`` / ``vb`` over the eval set, at timesteps and noise fixed by (--eval-seed, rank,
        batch index): the same every epoch for a given number of processes."""
        was_training = model.training
        model.eval()
        sums = {"loss": 0.0, "mse": 0.0, "vb": 0.0}
        count = 0
        for i, batch in enumerate(loader):
            images, y = self._to_device(batch)
            g = self._generator(step_seed(self.args.eval_seed, _EVAL, self.dist.rank, i))
            x0 = self._encode(images, g)
            t, noise = self._draw(x0, g)
            terms = self.diffusion.loss(model, x0, y, t, noise)
            for k in sums:
                if k in terms:
                    sums[k] += float(terms[k].double().sum())
            count += x0.shape[0]
        model.train(was_training)
        keys = list(sums)
        totals = all_reduce_sum([sums[k] for k in keys] + [count], self.dist.device)
        n = max(totals[-1], 1.0)
        out = {k: v / n for k, v in zip(keys, totals[:-1])}
        if not self.diffusion.learn_sigma:
            out.pop("vb")
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))
