"""2-D rotary position embedding of H-ViT3, computed for the actual feature-map size: the one 2-D RoPE of the zoo,
``ttt_zoo.kernels.rope`` (the kernels apply it too)."""

from ttt_zoo.kernels.rope import rope_2d as apply_rope_2d
from ttt_zoo.kernels.rope import rope_2d_tables

__all__ = ["rope_2d_tables", "apply_rope_2d"]
