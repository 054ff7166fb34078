"""SD3.5-T5: Stable Diffusion 3.5 with TTT layers that inherit every pretrained weight (diffusers)."""
