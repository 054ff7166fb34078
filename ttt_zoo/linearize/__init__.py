"""Turn a pretrained softmax transformer into its TTT counterpart by inheriting every weight.

"Linearizing Vision Transformer with Test-Time Training" (arXiv 2605.02772): all original parameters are copied
exactly; only the TTT-specific ones are newly initialised, and train with a larger learning rate
(:data:`LR_SCALES`, applied by :func:`param_groups`).  One entry point, :func:`linearize`, per source family:

- timm ``VisionTransformer`` / DeiT -> T5 / T5+ (:mod:`.vit`)
- a softmax DiT -> DiT5 (:mod:`.dit`)
- a diffusers ``SD3Transformer2DModel`` -> SD3.5-T5 (:mod:`.sd3`; needs diffusers, imported on use)

This package depends on the model packages (``ttt_zoo.models``, ``ttt_zoo.sd3``), never the reverse.
"""
from typing import List, Tuple

from torch import nn

from .lr_scales import LR_SCALES, is_sd3_transformer, model_family
from .param_groups import dit5_param_groups, param_groups, sd3_param_groups
from .vit import linearize_vit
from .dit import linearize_dit

__all__ = ["linearize", "param_groups", "LR_SCALES", "model_family", "is_sd3_transformer", "linearize_vit",
           "linearize_dit", "linearize_sd3", "sd3_param_groups", "dit5_param_groups"]


def linearize(model: nn.Module, **kwargs) -> Tuple[nn.Module, List[str]]:
    """Convert a softmax ViT / DeiT into T5, a softmax DiT into DiT5, or a diffusers SD3 transformer into SD3.5-T5.

    Returns ``(converted_model, new_param_names)``: the names of the only parameters that were newly initialised.
    Keyword arguments go to the family's converter (:func:`linearize_vit`: ``na_kernel``, ``img_size``;
    :func:`linearize_dit`: ``kernel_size``, ``dilation``; ``linearize_sd3``: the ``ttt_*`` layout options).
    """
    family = model_family(model)
    if family == "dit":
        return linearize_dit(model, **kwargs)
    if family == "sd3":
        from .sd3 import linearize_sd3  # diffusers is optional: imported only for an SD3 model
        return linearize_sd3(model, **kwargs)
    from timm.models.vision_transformer import VisionTransformer
    if isinstance(model, VisionTransformer):
        return linearize_vit(model, **kwargs)
    raise TypeError(f"linearize() converts timm VisionTransformer / DeiT models (to T5), softmax DiT models "
                    f"(to DiT5) and diffusers SD3Transformer2DModel (to SD3.5-T5); got {type(model).__name__}.")


def __getattr__(name: str):
    if name == "linearize_sd3":  # needs diffusers: imported on first use
        from .sd3 import linearize_sd3
        return linearize_sd3
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
