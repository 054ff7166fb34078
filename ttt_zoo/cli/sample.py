"""``ttt-zoo sample``: class-conditional samples of a DiT-family model (dit_*, dit3_*, dit5_*) as a PNG grid.

    ttt-zoo sample --model dit3_b_2 --checkpoint 0400000.pt --vae path/to/sd-vae-ft-ema \\
        --labels 207 360 387 974 88 979 417 279 --steps 250 --cfg 4.0 --out samples.png
    ttt-zoo sample --checkpoint output/train/digits-dit3 --cfg 2 --out digits.png   # a `ttt-zoo train` folder
    ttt-zoo sample --model dit3_s_2 --tiny --steps 4 --out smoke.png                # no files needed

``--checkpoint`` takes a file (the official ``{'model', 'ema', ...}`` layout, whose EMA weights are used; a bare
state dict; a ``.safetensors``) or the output folder of ``ttt-zoo train --task diffusion``, whose ``args.yaml``
gives the model, its kwargs, the VAE and the image size, and whose EMA weights are used when it has them.  The
model's input size, channels and classes are read from the weights.  ``--vae`` is a local diffusers
``AutoencoderKL`` folder (never downloaded); pixel-space models (3 input channels) need none.  The grid shows each
sample at the model's image size (latents without ``--vae``: the size they decode to) and at least 128 px, ``--nrow``
per row (torchvision's ``make_grid`` name); ``--upscale N`` sets the enlargement instead.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Tuple

__all__ = ["add_parser", "run"]

IMAGENET_LABELS = [207, 360, 387, 974, 88, 979, 417, 279]  # the official sample.py's classes


def _shape_kwargs(sd, model_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """input_size, in_chans and num_classes of the model the weights were trained as (unless given)."""
    out = {}
    w = sd.get("x_embedder.proj.weight")
    table = sd.get("y_embedder.embedding_table.weight")
    pos = sd.get("pos_embed")
    if w is not None:
        out["in_chans"] = int(w.shape[1])
        if pos is not None:
            side = int(round(pos.shape[1] ** 0.5))
            if side * side == pos.shape[1]:
                out["input_size"] = side * int(w.shape[-1])
    if table is not None:
        null = int(float(model_kwargs.get("class_dropout_prob", 0.1)) > 0)
        out["num_classes"] = int(table.shape[0]) - null
    out.update(model_kwargs)
    return out


def _check_diffusion(name: str) -> None:
    from ttt_zoo.registry import resolve_model_name
    resolve_model_name(name, "diffusion", "--model")  # an unknown name: the close ones


def _tiny(args) -> Tuple[Any, Any, List[int]]:
    import timm
    import torch
    from diffusers import AutoencoderKL
    _check_diffusion(args.model)
    torch.manual_seed(args.seed)
    model = timm.create_model(args.model, input_size=16, patch_size=2, hidden_size=64, depth=2, num_heads=2,
                              num_classes=10, **args.model_kwargs)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.normal_(std=0.05)
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        block_out_channels=(8, 8), latent_channels=4, norm_num_groups=4)
    return model, vae.eval(), [lab % 10 for lab in (args.labels or range(8))]


def _build(args) -> Tuple[Any, Any, Dict[str, Any]]:
    """(model, vae or None, the run's args.yaml) from --model / --checkpoint / --vae."""
    import timm
    import ttt_zoo  # noqa: F401
    from ttt_zoo.checkpoint import load_checkpoint_file
    from ttt_zoo.models.dit import checkpoint_filter_fn
    from ttt_zoo.run_folder import resolve_checkpoint
    from ttt_zoo.sampling import SD_VAE_FACTOR
    from ttt_zoo.train.diffusion import build_dit, load_vae, vae_factor
    resolved = resolve_checkpoint(args.checkpoint)  # a run folder: its EMA weights first; any file: checked
    run_args, weights = resolved.run, resolved.weights
    model_name = args.model or resolved.model
    if not model_name:
        raise ValueError("give --model (e.g. dit3_b_2), or --checkpoint with a `ttt-zoo train` folder.")
    _check_diffusion(model_name)
    vae_dir = args.vae or run_args.get("vae")
    vae = load_vae(vae_dir) if vae_dir else None
    same_run = resolved.same_model(args.model)  # else only the folder's weights are used
    from ttt_zoo.run_folder import run_model_kwargs
    model_kwargs = run_model_kwargs(resolved, model_name, dict(args.model_kwargs), with_img_size=False)
    sd = None
    if weights:
        from ttt_zoo.checkpoint import unwrap_checkpoint
        raw = load_checkpoint_file(weights)
        sd = unwrap_checkpoint(raw, prefer_ema=True)
        model_kwargs = _shape_kwargs(sd, model_kwargs)
    if args.image_size and "input_size" not in args.model_kwargs:
        in_chans = model_kwargs.get("in_chans", 4)
        f = vae_factor(vae) if vae is not None else (1 if in_chans == 3 else SD_VAE_FACTOR)
        if args.image_size % f:
            raise ValueError(f"--image-size {args.image_size} is not divisible by the VAE factor {f}.")
        model_kwargs["input_size"] = args.image_size // f
    # a run records the model as built (a linearized DiT: the dit5_* it became); a run from before records did not
    linearize_from = run_args.get("linearize_from") if same_run and not resolved.record.get("format") else None
    model, _ = build_dit(model_name, linearize_from=linearize_from, **model_kwargs)
    if sd is not None:
        model.load_state_dict(checkpoint_filter_fn(sd, model))
    return model, vae, run_args


def run(args) -> int:
    import torch
    from ttt_zoo.checkpoint import CheckpointError
    from ttt_zoo.sampling import SD_VAE_FACTOR, grid_nrow, grid_upscale, sample, save_image_grid
    from ttt_zoo.torchcompile import check_torchcompile, compile_model
    from ._common import UsageError, check_out, error_line
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        check_torchcompile(args.torchcompile, args.torchcompile_mode)
        check_out(args.out, args.force)
        if args.tiny:
            model, vae, labels = _tiny(args)
        else:
            model, vae, _ = _build(args)
            n = model.num_classes
            labels = args.labels or (IMAGENET_LABELS if n == 1000 else list(range(min(n, 16))))
            bad = [lab for lab in labels if not 0 <= lab < n]
            if bad:
                raise ValueError(f"--labels {bad} are outside the model's {n} classes (0..{n - 1}).")
    except (CheckpointError, UsageError, ValueError, FileNotFoundError) as e:
        print(error_line(e, args) or f"error: {e}", file=sys.stderr)  # (the Hub's errors: the one offline line)
        return 2
    model = model.to(device).eval()
    # the forward in place: forward_with_cfg (guidance) calls self.forward
    model = compile_model(model, args.torchcompile, args.torchcompile_mode, forward_only=True)
    vae = vae.to(device).eval() if vae is not None else None
    pixels = vae is None and model.in_chans == 3
    images = sample(model, labels, num_steps=args.steps, scheduler=args.scheduler, cfg_scale=args.cfg,
                    guidance_channels=args.guidance_channels or min(3, model.in_chans), seed=args.seed, vae=vae,
                    progress=True)
    from ttt_zoo.finite import FiniteCheck
    finite = FiniteCheck(f"the samples of {args.model or 'the run'}", "samples")
    finite.add(images, lambda i: f"sample {i}, label {labels[i]}")
    try:
        finite.check()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    decoded = vae is not None or pixels
    side = tuple(images.shape[-2:])
    image_hw = side if decoded else tuple(SD_VAE_FACTOR * s for s in side)  # a latent: the image it stands for
    upscale = args.upscale or grid_upscale(side, image_hw)
    nrow = grid_nrow(len(labels), args.nrow)
    from PIL import Image
    save_image_grid(images, args.out, nrow=nrow, value_range=(-1.0, 1.0) if pixels else None, upscale=upscale)
    what = "images" if decoded else "latents (no --vae: first 3 channels, min-max scaled)"
    grid_w, grid_h = Image.open(args.out).size
    print(f"wrote {args.out} ({grid_w} x {grid_h} px, {nrow} per row, each {upscale * side[0]} x {upscale * side[1]} "
          f"px{f', enlarged {upscale}x' if upscale > 1 else ''}): {len(labels)} {what} of {tuple(images.shape[1:])} "
          f"from {args.model or 'the run'}, {args.steps} {args.scheduler} steps, cfg {args.cfg}, labels {list(labels)}")
    return 0


def add_parser(sub) -> None:
    from ttt_zoo.flags import MAX_IMG_SIDE, MAX_SEED, ModelKwargs, Range
    from ttt_zoo.torchcompile import add_torchcompile_args
    p = sub.add_parser("sample", help="class-conditional DiT / DiT3 / DiT5 samples with guidance, as a PNG grid",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="DiT-family model (default: the training folder's)")
    p.add_argument("--model-kwargs", nargs="*", default={}, action=ModelKwargs, metavar="K=V",
                   help="constructor arguments, e.g. hidden_size=64 depth=2 (a training folder's are used too)")
    p.add_argument("--checkpoint", default=None, help="weights file, or a `ttt-zoo train` output folder")
    p.add_argument("--vae", default=None, metavar="DIR", help="local diffusers AutoencoderKL folder")
    p.add_argument("--image-size", type=Range(int, ge=1, le=MAX_IMG_SIDE), default=None,
                   help="output pixels (latents are image_size / the VAE factor); default: the model's size")
    p.add_argument("--labels", type=Range(int, ge=0, le=1_000_000), nargs="+", default=None,
                   help="one class per sample (default: the official 8 ImageNet classes, else classes 0..15)")
    p.add_argument("--steps", type=Range(int, ge=1, le=1000), default=250, help="sampling steps (respaced from 1000)")
    p.add_argument("--scheduler", choices=["ddpm", "ddim"], default="ddpm")
    p.add_argument("--cfg", type=Range(float, ge=0, le=100), default=4.0,
                   help="classifier-free guidance scale (1 = none)")
    p.add_argument("--guidance-channels", type=Range(int, ge=1, le=64), default=None,
                   help="eps channels guided (default 3: the official DiT quirk for 4-channel latents, all of a "
                        "pixel model's; 4 = the standard recipe for latents)")
    p.add_argument("--seed", type=Range(int, ge=0, le=MAX_SEED), default=0)
    p.add_argument("--device", default=None, help="default: cuda when available")
    add_torchcompile_args(p)
    p.add_argument("--nrow", type=Range(int, ge=1, le=1024), default=None,
                   help="images per grid row, as torchvision's make_grid / save_image (default: about square)")
    p.add_argument("--upscale", type=Range(int, ge=1, le=64), default=None, metavar="N",
                   help="enlarge every image N times in the grid (nearest neighbour); default: to the model's image "
                        "size (latents without --vae: the size they decode to, 8x) and at least 128 px, e.g. 8 for "
                        "16-px samples; 1: as sampled")
    p.add_argument("--tiny", action="store_true", help="tiny random model and VAE (no files; a smoke test)")
    p.add_argument("--out", default="samples.png", help="PNG grid to write")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.set_defaults(func=run)
