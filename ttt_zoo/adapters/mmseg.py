"""mmseg entry point: ``custom_imports = dict(imports=['ttt_zoo.adapters.mmseg'], allow_failed_imports=False)``.

Registers ``TTTHViT3`` and ``TTTTimm`` in mmseg's ``MODELS`` registry (and mmdet's, when installed), and makes
mmengine load checkpoints with ``weights_only=True`` (see ``ttt_zoo.adapters._mm``).
"""
from ._mm import install, toolbox_models

install(toolbox_models("mmseg"), also="mmdet")
