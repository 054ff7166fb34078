"""SD3.5-T5: Stable Diffusion 3.5 with TTT layers that inherit every pretrained weight (diffusers).

``linearize_sd3`` (also ``ttt_zoo.linearize``) converts an ``SD3Transformer2DModel``; ``SD3T5Transformer2DModel``
is the diffusers model class (``from_pretrained`` of a softmax folder converts too).  See docs/sd3.md.
"""
from .attention import SD3TTT, SD3TTTAttention, SD3TTTAttnProcessor, TTTProcessorError
from .convert import SD3_LR_MULTIPLIER, is_sd3_transformer, linearize_sd3, sd3_param_groups
from .transformer import SD3LayoutError, SD3T5Transformer2DModel, default_ttt_layers

__all__ = ["SD3TTT", "SD3TTTAttention", "SD3TTTAttnProcessor", "TTTProcessorError", "SD3_LR_MULTIPLIER",
           "is_sd3_transformer", "linearize_sd3", "sd3_param_groups", "SD3LayoutError", "SD3T5Transformer2DModel",
           "default_ttt_layers"]
