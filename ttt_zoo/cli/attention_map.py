"""``ttt-zoo attention-map``: the implicit attention score dO_i/dV_j (T5 paper Eq. 13, Figure 4) of one query
pixel, per chosen mixer layer, as a heat-map overlay on the image.

    ttt-zoo attention-map --model vit3_tiny --image ttt_zoo/assets/chelsea.jpg --query-pixel 150 200 --out map.png
    ttt-zoo attention-map --model t5_tiny --query-pixel 150 200 --layer 0 5 11 --map explicit --out map.png
"""

import os

__all__ = ["add_parser", "run", "load_image", "plot_maps"]


def load_image(path: str, size, mean, std):
    """(1, 3, h, w) normalised tensor of the whole image resized to ``size`` (no crop, so pixel positions map
    linearly), plus the resized RGB image as a float array in [0, 1] and the original (H, W)."""
    import numpy as np
    import torch
    from PIL import Image
    from ttt_zoo.images import open_rgb
    if not os.path.isfile(path):
        raise FileNotFoundError(f"image {path!r} does not exist; give the path of a .jpg / .png file")
    img = open_rgb(path)  # upright (EXIF), 16-bit scaled to 8
    orig = (img.height, img.width)
    rgb = np.asarray(img.resize((size[1], size[0]), Image.BICUBIC), dtype=np.float32) / 255.0
    x = (torch.from_numpy(rgb).permute(2, 0, 1) - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return x.unsqueeze(0), rgb, orig


def plot_maps(rgb, query_pixel, maps, path: str, title: str, orig_size=None) -> None:
    """The image with the query marked, then one overlay per layer (mean |A| over heads, upsampled, scaled to its
    maximum) and a colour bar.  ``rgb`` is the image as the model saw it; it is drawn at the original image's
    aspect ratio ``orig_size`` (H, W) with the query at ``query_pixel`` (row, col) in original pixels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch.nn.functional as F
    from ttt_zoo.fileio import atomic_write
    h, w = rgb.shape[:2]
    oh, ow = orig_size or (h, w)
    extent = (0, ow, oh, 0)  # model-size pixels drawn over the original's extent: the aspect ratio is kept
    y, x = query_pixel
    panel_h = 3.2 * oh / max(oh, ow)
    panel_w = 3.2 * ow / max(oh, ow)
    fig, axes = plt.subplots(1, len(maps) + 1, figsize=(panel_w * (len(maps) + 1) + 0.8, panel_h + 0.9),
                             squeeze=False)
    axes = axes[0]
    axes[0].imshow(rgb, extent=extent)
    axes[0].set_title("image + query", fontsize=9)
    for ax in axes:
        ax.axis("off")
    shown = None
    for ax, m in zip(axes[1:], maps):
        heat = m["map"].abs().mean(0)[None, None].float()
        heat = F.interpolate(heat, size=(h, w), mode="bilinear", align_corners=False)[0, 0]
        heat = heat / heat.max().clamp_min(1e-30)
        ax.imshow(rgb, extent=extent)
        shown = ax.imshow(heat.numpy(), cmap="jet", alpha=0.55, vmin=0, vmax=1, extent=extent)
        ax.set_title(f"layer {m['layer']} ({m['feat_size'][0]}x{m['feat_size'][1]})", fontsize=9)
    for ax in axes:
        ax.plot([x], [y], marker="x", color="white", markersize=10, mew=2.5)
        ax.plot([x], [y], marker="x", color="black", markersize=7, mew=1.2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if shown is not None:
        fig.colorbar(shown, ax=list(axes), fraction=0.025, pad=0.02, label="|A| / max |A| (per layer)")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), binary=True)
    plt.close(fig)


def run(args) -> int:
    import timm
    import torch
    from ttt_zoo.registry import create_model, resolve_model_name
    from ttt_zoo.analysis import image_attention_maps
    from ._common import UsageError, model_kwargs
    resolved = None
    if args.checkpoint:  # a run folder or a file in one: its committed, checked weights and the run's record
        from ttt_zoo.run_folder import resolve_checkpoint
        resolved = resolve_checkpoint(args.checkpoint)
        args.model = args.model or resolved.model
    if not args.model:
        raise UsageError("no model given; give --model NAME, or --checkpoint with a `ttt-zoo train` run folder "
                         "(its run.json names the model)")
    resolve_model_name(args.model, "image", "--model")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("error: attention-map draws with matplotlib, which is not installed (pip install matplotlib)")
    if not os.path.isfile(args.image):
        raise SystemExit(f"error: --image {args.image!r} does not exist; give the path of a .jpg / .png file")
    from ttt_zoo.images import open_rgb
    im = open_rgb(args.image)  # the upright image: --query-pixel is in its pixels
    orig = (im.height, im.width)
    y0, x0 = args.query_pixel
    if not (0 <= y0 < orig[0] and 0 <= x0 < orig[1]):
        raise SystemExit(f"error: --query-pixel {y0} {x0} (row col) is outside the {orig[0]} x {orig[1]} image")
    from ._common import check_out
    check_out(args.out, args.force)
    run_size = None
    if resolved is not None:
        from ttt_zoo.hub import build_from_checkpoint
        from ttt_zoo.run_folder import run_model_kwargs
        kwargs = run_model_kwargs(resolved, args.model, model_kwargs(args))
        model, _ = build_from_checkpoint(args.model, resolved.weights, kwargs)
        note = f"weights: {os.path.basename(resolved.weights)}"
        run_size = resolved.img_size(args.model)  # the size the run trained at
    else:
        model = create_model(args.model, pretrained=False, **model_kwargs(args))
        note = "random init (no checkpoint given)"
    model = model.eval()  # the maps are taken in float64 on copies of the chosen mixers
    cfg = timm.data.resolve_data_config({}, model=model)
    size = args.img_size or run_size or tuple(cfg["input_size"][1:])
    x, rgb, _ = load_image(args.image, size, cfg["mean"], cfg["std"])
    qp = (y0 * size[0] / orig[0], x0 * size[1] / orig[1])  # in the resized image
    maps = image_attention_maps(model, x, qp, args.layer, args.map, args.via, reduce=args.reduce)
    what = "implicit tr(dO_i/dV_j)/d" if args.map == "implicit" else "explicit linear-attention map"
    plot_maps(rgb, (y0, x0), maps, args.out, f"{args.model}: {what}, mean |A| over heads; {note}", orig_size=orig)
    print(f"wrote {args.out}: {len(maps)} layer(s) "
          + ", ".join(f"{m['layer']} (query token {m['query']} of {m['feat_size']})" for m in maps))
    return 0


def add_parser(sub) -> None:
    from ._common import add_model_kwargs
    from ttt_zoo.flags import Range, SizeRange
    from .demo import ASSET_IMAGE
    p = sub.add_parser("attention-map", help="implicit attention map dO_i/dV_j of one query pixel (PNG overlay)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="an image model (see `ttt-zoo list`; default: the run's, with a run folder as --checkpoint)")
    p.add_argument("--image", default=ASSET_IMAGE, help="image file (default: the bundled photo)")
    p.add_argument("--query-pixel", type=Range(int, ge=0, le=65535), nargs=2, required=True, metavar=("Y", "X"),
                   help="query pixel, row and column in the image's own pixels")
    p.add_argument("--layer", type=Range(int, ge=-1000, le=999), nargs="+", default=None,
                   help="mixer layers in forward order (negative from the end); default first, middle, last")
    p.add_argument("--checkpoint", default=None,
                   help="weights file (.pth / .safetensors, official or ours) or a `ttt-zoo train` run folder")
    add_model_kwargs(p)
    p.add_argument("--img-size", type=SizeRange(), default=None,
                   help="model input size, 224 or HxW (default: the run's, else the model's)")
    p.add_argument("--map", choices=("implicit", "explicit"), default="implicit",
                   help="implicit dO_i/dV_j (any mixer) or the explicit linear-attention map q_hat_i . k_hat_j")
    p.add_argument("--via", choices=("mixer", "form"), default="mixer",
                   help="implicit map through the mixer's own code (hooks) or its linear-attention form")
    p.add_argument("--reduce", choices=("trace", "probe"), default="trace",
                   help="implicit score per head: mean diagonal of dO_i/dV_j (d VJPs, exact) or its one-VJP "
                        "Rademacher probe (exact where the Jacobian is diagonal)")
    p.add_argument("--out", required=True, help="output PNG")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.set_defaults(func=run)
