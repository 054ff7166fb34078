"""mmdet entry point: ``custom_imports = dict(imports=['ttt_zoo.adapters.mmdet'], allow_failed_imports=False)``.

Registers ``TTTHViT3`` and ``TTTTimm`` in mmdet's ``MODELS`` registry (and mmseg's, when installed), and makes
mmengine load checkpoints with ``weights_only=True`` (see ``ttt_zoo.adapters._mm``).
"""
from mmdet.registry import MODELS

from ._mm import install_safe_loader, register

register(MODELS)
try:
    from mmseg.registry import MODELS as _SEG_MODELS
except ImportError:  # mmseg is optional here
    _SEG_MODELS = None
if _SEG_MODELS is not None:
    register(_SEG_MODELS)
install_safe_loader()
