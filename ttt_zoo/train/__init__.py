"""Training: ``ttt-zoo train`` / ``validate`` on timm (classification) and diffusers (diffusion) components."""
