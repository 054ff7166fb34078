"""mmseg entry point: ``custom_imports = dict(imports=['ttt_zoo.adapters.mmseg'], allow_failed_imports=False)``.

Registers ``TTTHViT3`` and ``TTTTimm`` in mmseg's ``MODELS`` registry (and mmdet's, when installed), and makes
mmengine load checkpoints with ``weights_only=True`` (see ``ttt_zoo.adapters._mm``).
"""
from mmseg.registry import MODELS

from ._mm import install_safe_loader, register

register(MODELS)
try:
    from mmdet.registry import MODELS as _DET_MODELS
except ImportError:  # mmdet is optional here
    _DET_MODELS = None
if _DET_MODELS is not None:
    register(_DET_MODELS)
install_safe_loader()
