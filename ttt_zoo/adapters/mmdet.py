"""mmdet entry point: ``custom_imports = dict(imports=['ttt_zoo.adapters.mmdet'], allow_failed_imports=False)``.

Registers ``TTTHViT3`` and ``TTTTimm`` in mmdet's ``MODELS`` registry (and mmseg's, when installed), and makes
mmengine load checkpoints with ``weights_only=True`` (see ``ttt_zoo.adapters._mm``).
"""
from ._mm import install, toolbox_models

install(toolbox_models("mmdet"), also="mmseg")
