"""SD3.5-T5: Stable Diffusion 3.5 with TTT layers that inherit every pretrained weight (diffusers).

``ttt_zoo.linearize`` converts an ``SD3Transformer2DModel``; ``SD3T5Transformer2DModel`` is the diffusers model
class (``from_pretrained`` of a softmax folder converts too).  See docs/sd3.md.
"""
from .attention import SD3TTT, SD3TTTAttention, SD3TTTAttnProcessor, TTTProcessorError
from .transformer import SD3LayoutError, SD3T5Transformer2DModel, default_ttt_layers

__all__ = ["SD3TTT", "SD3TTTAttention", "SD3TTTAttnProcessor", "TTTProcessorError", "SD3LayoutError",
           "SD3T5Transformer2DModel", "default_ttt_layers"]
