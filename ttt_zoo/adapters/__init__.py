"""Detection / segmentation adapters.

``dense`` holds the backbones (plain PyTorch); ``mmdet`` / ``mmseg`` register them with OpenMMLab (import those
through ``custom_imports`` in a config).  Install the OpenMMLab stack with ``make openmmlab``.
"""
from .dense import HViT3Dense, SimplePyramid, TimmDense


def allow_unsafe_checkpoints() -> None:
    """Opt in (trusted files only) to mmengine checkpoints that need full unpickling; see ``_mm``."""
    from ._mm import allow_unsafe_checkpoints as _allow
    _allow()


__all__ = ["HViT3Dense", "TimmDense", "SimplePyramid", "allow_unsafe_checkpoints"]
