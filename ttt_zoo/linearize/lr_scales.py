"""Which family a model belongs to, and the learning-rate scale of its newly initialised TTT parameters."""
from torch import nn

__all__ = ["LR_SCALES", "model_family", "is_sd3_transformer"]

#: ``lr_scale`` of the new TTT parameters relative to the inherited ones (timm's schedulers multiply each group's lr
#: by it), per family of :func:`model_family`
LR_SCALES = {
    # ViT / DeiT -> T5: "Linearizing Vision Transformer with Test-Time Training" (arXiv 2605.02772), Table 8: 20x
    "vit": 20.0,
    # DiT -> DiT5: the same paper, the TTT inner weights (W1, W2) at 2x (official DiT5/train.py ``--ttt-lr-scale``)
    "dit": 2.0,
    # SD3 / SD3.5 -> SD3.5-T5: the paper's recipe (Table 9) lists no multiplier, so 1 (docs/sd3.md)
    "sd3": 1.0,
}


def is_sd3_transformer(model: nn.Module) -> bool:
    """True for diffusers' ``SD3Transformer2DModel`` and subclasses (checked by name: no diffusers import)."""
    return any(c.__name__ == "SD3Transformer2DModel" for c in type(model).__mro__)


def model_family(model: nn.Module) -> str:
    """``"sd3"`` (a diffusers SD3 transformer, softmax or SD3.5-T5), ``"dit"`` (a DiT-style model: ``x_embedder``
    and ``t_embedder``, softmax or DiT5) or ``"vit"`` (anything else: the classification models)."""
    if is_sd3_transformer(model):
        return "sd3"
    if hasattr(model, "x_embedder") and hasattr(model, "t_embedder"):
        return "dit"
    return "vit"
