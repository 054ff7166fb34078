"""Sample class-conditional images from a DiT-family model (dit_*, dit3_*, dit5_*) into a PNG grid.

    python tools/sample_dit.py --model dit3_b_2 --checkpoint 0400000.pt --vae path/to/sd-vae-ft-ema \
        --labels 207 360 387 974 88 979 417 279 --steps 250 --cfg 4.0 --out samples.png

``--checkpoint`` takes the official ``{'model', 'ema', ...}`` files (EMA weights used) or a bare state dict;
``--vae`` a local diffusers AutoencoderKL folder (no download).  ``--tiny`` runs a randomly initialised tiny
model and VAE, which needs no files (a smoke test of the whole path).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import timm  # noqa: E402

import ttt_zoo  # noqa: E402,F401
from ttt_zoo.checkpoint import safe_torch_load  # noqa: E402
from ttt_zoo.models.dit import checkpoint_filter_fn  # noqa: E402
from ttt_zoo.sampling import sample, save_image_grid  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dit3_b_2")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--vae", default=None, help="local diffusers AutoencoderKL folder")
    p.add_argument("--image-size", type=int, default=256, help="pixels; latents are image_size / 8")
    p.add_argument("--labels", type=int, nargs="+", default=[207, 360, 387, 974])
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--scheduler", choices=["ddpm", "ddim"], default="ddpm")
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--guidance-channels", type=int, default=3, help="3 = official DiT quirk, 4 = all eps channels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="tiny random model and VAE (no files needed)")
    p.add_argument("--out", default="samples.png")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    if args.tiny:
        from diffusers import AutoencoderKL
        torch.manual_seed(args.seed)
        model = timm.create_model(args.model, input_size=16, patch_size=2, hidden_size=64, depth=2, num_heads=2, num_classes=10)
        for param in model.parameters():
            if param.requires_grad:
                torch.nn.init.normal_(param, std=0.05)
        vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                            block_out_channels=(8, 8), latent_channels=4, norm_num_groups=4)
        labels, latent = [l % 10 for l in args.labels], 16
    else:
        latent = args.image_size // 8
        model = timm.create_model(args.model, input_size=latent)
        if args.checkpoint:
            model.load_state_dict(checkpoint_filter_fn(safe_torch_load(args.checkpoint), model))
        vae = None
        if args.vae:
            from diffusers import AutoencoderKL
            vae = AutoencoderKL.from_pretrained(args.vae, local_files_only=True)
        labels = args.labels
    model = model.to(device).eval()
    vae = vae.to(device).eval() if vae is not None else None
    images = sample(model, labels, num_steps=args.steps, scheduler=args.scheduler, cfg_scale=args.cfg,
                    guidance_channels=args.guidance_channels, latent_size=latent, seed=args.seed, vae=vae,
                    progress=True)
    save_image_grid(images, args.out)
    print(f"wrote {args.out}: {tuple(images.shape)} from {args.model}, {args.steps} {args.scheduler} steps, "
          f"cfg {args.cfg}")


if __name__ == "__main__":
    main()
