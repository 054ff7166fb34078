"""Class-conditional sampling for the DiT family (dit, dit3, dit5) on diffusers' schedulers.

The diffusion process is the one the DiT models are trained with (1000 steps, linear betas 1e-4..0.02,
eps prediction, learned-range variance when ``learn_sigma``).  Classifier-free guidance follows the official
``sample.py``: the batch is [labels; null class], the model's ``forward_with_cfg`` guides eps, the first half is
kept.  Latents are decoded by a diffusers VAE when one is given (e.g. ``AutoencoderKL`` of stabilityai/sd-vae-ft-ema,
scaling factor 0.18215) and can be written as a PNG grid.

Needs the ``diffusion`` extra: ``pip install ttt-zoo[diffusion]`` (diffusers).
"""
from __future__ import annotations

import inspect
import math
import os
from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import nn

__all__ = ["make_scheduler", "sample", "save_image_grid", "image_grid", "grid_upscale", "grid_nrow",
           "SD_VAE_FACTOR", "MIN_CELL_PX"]

SCHEDULERS = ("ddpm", "ddim")

#: spatial downsampling of the SD VAE (stabilityai/sd-vae-ft-ema) the DiTs are trained on: a 256-px image is a 32-px
#: latent; a latent model without its VAE at hand is taken to be this VAE's
SD_VAE_FACTOR = 8

#: the least side a sample is shown at in a grid unless told otherwise (a 16-px sample alone would be a speck)
MIN_CELL_PX = 128


def _diffusers():
    try:
        import diffusers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("ttt_zoo.sampling needs diffusers: pip install 'ttt-zoo[diffusion]' "
                          "(or pip install diffusers).") from e
    return diffusers


def make_scheduler(name: str = "ddpm", learn_sigma: bool = True, num_train_timesteps: int = 1000):
    """The DiT training process as a diffusers scheduler.

    ``'ddpm'``: ancestral sampling with the learned-range variance when ``learn_sigma`` (fixed-small otherwise),
    respaced like the official ``space_timesteps`` (``timestep_spacing='linspace'``: 250 steps run 999, 995, ..., 0;
    diffusers' posterior uses the kept steps' alphas_cumprod, as the respaced official process does);
    ``'ddim'``: deterministic DDIM (eta 0; the variance output is unused; diffusers' DDIM steps by a fixed stride, so
    it keeps the ``'leading'`` spacing 996, ..., 0).  No clipping, as in DiT.  The training task
    (:mod:`ttt_zoo.train.diffusion`) builds its noise process here too."""
    d = _diffusers()
    common = dict(num_train_timesteps=num_train_timesteps, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                  clip_sample=False, prediction_type="epsilon")
    if name == "ddpm":
        return d.DDPMScheduler(variance_type="learned_range" if learn_sigma else "fixed_small",
                               timestep_spacing="linspace", **common)
    if name == "ddim":
        return d.DDIMScheduler(set_alpha_to_one=True, **common)
    raise ValueError(f"Unknown scheduler {name!r}; choose one of {SCHEDULERS} or pass a diffusers scheduler.")


def _latent_hw(model: nn.Module, latent_size: Optional[Union[int, Tuple[int, int]]]) -> Tuple[int, int]:
    if latent_size is None:
        gh, gw = model.grid_size
        return gh * model.patch_size, gw * model.patch_size
    if isinstance(latent_size, int):
        return latent_size, latent_size
    return int(latent_size[0]), int(latent_size[1])


@torch.no_grad()
def sample(
        model: nn.Module,
        class_labels: Union[Sequence[int], torch.Tensor],
        num_steps: int = 250,
        scheduler: Any = "ddpm",
        cfg_scale: float = 4.0,
        guidance_channels: int = 3,
        latent_size: Optional[Union[int, Tuple[int, int]]] = None,
        seed: Optional[int] = 0,
        generator: Optional[torch.Generator] = None,
        vae: Optional[nn.Module] = None,
        vae_scaling_factor: Optional[float] = None,
        eta: float = 0.0,
        progress: bool = False,
) -> torch.Tensor:
    """Sample one image (or latent) per label.

    Args:
        model: a DiT-family model (``forward(x, t, y)``, ``forward_with_cfg``, ``in_chans``, ``learn_sigma``).
        class_labels: class indices, one per sample.
        num_steps: sampling steps (respaced from the 1000 training steps; DiT uses 250).
        scheduler: ``'ddpm'``, ``'ddim'`` or a configured diffusers scheduler (its state is reset).
        cfg_scale: classifier-free guidance scale; <= 1 samples without guidance (no null-class pass).
        guidance_channels: channels guided by ``forward_with_cfg`` (3 = official DiT quirk, ``in_chans`` = standard).
        latent_size: latent (H, W) or side; default the size the model was built for.
        seed / generator: randomness of the initial noise and of DDPM steps (a generator wins over the seed).
        vae: a diffusers ``AutoencoderKL`` (or anything with ``decode(z).sample``); then images in [0, 1] are
            returned, else the final latents.
        vae_scaling_factor: latent scale; default ``vae.config.scaling_factor`` (0.18215 for the SD VAE).
        eta: DDIM noise (0 = deterministic).
        progress: show the steps (:class:`ttt_zoo.progress.Progress`: a bar on a terminal, else lines, once the
            run has taken a few seconds).
    Returns:
        (B, 3, H*f, W*f) images in [0, 1] with a VAE, else (B, in_chans, H, W) latents.
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    labels = torch.as_tensor(class_labels, dtype=torch.long, device=device).reshape(-1)
    n = labels.shape[0]
    if n == 0:
        raise ValueError("class_labels is empty; pass one label per sample.")
    if isinstance(scheduler, str):
        scheduler = make_scheduler(scheduler, learn_sigma=bool(getattr(model, "learn_sigma", False)))
    if vae is not None:
        latent_ch = getattr(getattr(vae, "config", None), "latent_channels", model.in_chans)
        if latent_ch != model.in_chans:
            raise ValueError(f"the VAE has {latent_ch} latent channels but the model takes {model.in_chans}.")
    if generator is None:
        generator = torch.Generator(device=device)
        generator.manual_seed(0 if seed is None else seed)
    h, w = _latent_hw(model, latent_size)
    scheduler.set_timesteps(num_steps, device=device)

    use_cfg = cfg_scale > 1.0
    x = torch.randn(n, model.in_chans, h, w, generator=generator, device=device, dtype=dtype)
    if use_cfg:
        null = getattr(model, "num_classes", None)
        if null is None or model.y_embedder.embedding_table.num_embeddings <= null:
            raise ValueError("classifier-free guidance needs a model trained with label dropout "
                             "(class_dropout_prob > 0, which adds the null class); use cfg_scale=1.")
        x = torch.cat([x, x], dim=0)
        labels = torch.cat([labels, torch.full_like(labels, null)], dim=0)
    x = x * scheduler.init_noise_sigma
    learned_var = getattr(scheduler.config, "variance_type", None) in ("learned", "learned_range")
    if learned_var and not getattr(model, "learn_sigma", False):
        raise ValueError("the scheduler uses a learned variance but the model has learn_sigma=False; "
                         "use variance_type='fixed_small' or make_scheduler(..., learn_sigma=False).")
    step_kwargs = {"eta": eta} if "eta" in inspect.signature(scheduler.step).parameters else {}
    if eta and not step_kwargs:
        raise ValueError(f"eta={eta} is only meaningful for DDIM; {type(scheduler).__name__} has no eta.")
    from ttt_zoo.progress import Progress
    steps = scheduler.timesteps
    bar = Progress(len(steps), "sample", interval=max(1, len(steps) // 10), unit="step", enabled=progress)
    for t in steps:
        inp = scheduler.scale_model_input(x, t)
        tt = torch.full((x.shape[0],), int(t), device=device, dtype=torch.long)
        if use_cfg:
            out = model.forward_with_cfg(inp, tt, labels, cfg_scale, guidance_channels=guidance_channels)
        else:
            out = model(inp, tt, labels)
        if not learned_var:
            out = out[:, :model.in_chans]
        x = scheduler.step(out, t, x, generator=generator, **step_kwargs).prev_sample
        bar.update(items=1)
    bar.close()
    if use_cfg:
        x = x[:n]
    if vae is None:
        return x
    scale = vae_scaling_factor if vae_scaling_factor is not None else vae.config.scaling_factor
    shift = getattr(vae.config, "shift_factor", None) or 0.0  # SD3-style VAEs; 0 for the SD VAE
    vdtype = next(vae.parameters()).dtype
    images = vae.decode(x.to(vdtype) / scale + shift).sample
    return ((images.float() + 1) / 2).clamp(0, 1)


def grid_upscale(sample_hw: Tuple[int, int], image_hw: Optional[Tuple[int, int]] = None,
                 min_side: int = MIN_CELL_PX) -> int:
    """The whole factor a grid enlarges each sample by: to the model's image size ``image_hw`` (a latent shown
    without its VAE: the size it decodes to) and to at least ``min_side`` px."""
    h, w = sample_hw
    big_h, big_w = image_hw or sample_hw
    return max(1, math.ceil(max(big_h / h, big_w / w, min_side / min(h, w))))


def grid_nrow(count: int, nrow: Optional[int] = None) -> int:
    """Images per grid row: ``nrow``, else about square."""
    return nrow or math.ceil(math.sqrt(count))


def image_grid(images: torch.Tensor, nrow: Optional[int] = None, padding: int = 2,
               value_range: Optional[Tuple[float, float]] = None, upscale: int = 1) -> torch.Tensor:
    """(B, C, H, W) -> (H', W', 3) uint8 grid, ``nrow`` images per row (torchvision's ``make_grid``), each image
    enlarged ``upscale`` times (nearest neighbour: the pixels stay sharp).

    Values are mapped from ``value_range``; without one, images already in [0, 1] are kept and anything else
    (raw latents) is min-max scaled per image.  Latents show their first 3 channels."""
    from torchvision.utils import make_grid
    if images.dim() != 4:
        raise ValueError(f"expected images (B, C, H, W), got shape {tuple(images.shape)}")
    if int(upscale) != upscale or upscale < 1:
        raise ValueError(f"upscale must be a positive integer, got {upscale}")
    x = images.detach().float().cpu()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    elif x.shape[1] != 3:
        x = x[:, :3] if x.shape[1] > 3 else torch.cat([x, x[:, :1].expand(-1, 3 - x.shape[1], -1, -1)], 1)
    if value_range is not None:
        lo, hi = value_range
        x = (x - lo) / (hi - lo)
    elif x.min() < 0 or x.max() > 1:  # e.g. raw latents: per-image min-max
        lo = x.amin(dim=(1, 2, 3), keepdim=True)
        hi = x.amax(dim=(1, 2, 3), keepdim=True)
        x = (x - lo) / (hi - lo).clamp_min(1e-12)
    x = x.clamp(0, 1)
    if upscale > 1:
        x = torch.nn.functional.interpolate(x, scale_factor=int(upscale), mode="nearest")
    grid = make_grid(x, nrow=grid_nrow(x.shape[0], nrow), padding=padding, pad_value=0.0)
    if x.shape[0] == 1 and padding:  # make_grid leaves a single image unframed; frame it like the others
        grid = torch.nn.functional.pad(grid, (padding,) * 4)
    return (grid.permute(1, 2, 0) * 255).round().to(torch.uint8)


def save_image_grid(images: torch.Tensor, path: str, nrow: Optional[int] = None, padding: int = 2,
                    value_range: Optional[Tuple[float, float]] = None, upscale: int = 1) -> str:
    """Write ``images`` (B, C, H, W) as one PNG grid (atomically: temp file, fsync, rename); returns the path."""
    from PIL import Image
    grid = Image.fromarray(image_grid(images, nrow, padding, value_range, upscale).numpy())
    from ttt_zoo.fileio import atomic_write
    atomic_write(path, lambda f: grid.save(f, format="PNG"), binary=True)
    return path
