"""``ttt-zoo list``: registered models with parameters and GFLOPs."""

from typing import Dict

import torch

__all__ = ["add_parser", "model_stats"]


def model_stats(name: str, img_size: int = 224) -> Dict[str, float]:
    """Parameters and GFLOPs (multiply-accumulates, as the papers count them) on the meta device.

    Image models are measured at ``img_size``; diffusion models (``forward(x, t, y)``) at their configured latent size.
    """
    import timm
    from torch.utils.flop_counter import FlopCounterMode
    from ttt_zoo.hub import example_inputs
    with torch.device("meta"):
        model = timm.create_model(name)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    inputs = example_inputs(model, 1, device="meta")
    if len(inputs) == 1:
        inputs = (torch.empty(1, getattr(model, "in_chans", 3), img_size, img_size, device="meta"),)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    return dict(params=params, gflops=counter.get_total_flops() / 2 / 1e9, input=list(inputs[0].shape[1:]))


def run(args) -> int:
    from ttt_zoo import list_zoo_models
    names = [n for n in list_zoo_models(include_diffusion=True) if not args.filter or args.filter in n]
    print(f"{'model':<22}{'params (M)':>12}{'GFLOPs':>10}  input")
    for n in names:
        try:
            s = model_stats(n, args.img_size)
            print(f"{n:<22}{s['params'] / 1e6:>12.3f}{s['gflops']:>10.2f}  {'x'.join(map(str, s['input']))}")
        except Exception as e:  # noqa: BLE001 - report and continue
            print(f"{n:<22}  (could not be measured: {type(e).__name__}: {e})")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("list", help="list registered models with parameters and GFLOPs")
    p.add_argument("--filter", default="", help="substring of model names")
    p.add_argument("--img-size", type=int, default=224)
    p.set_defaults(func=run)
