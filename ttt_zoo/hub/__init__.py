"""Hugging Face Hub support: convert checkpoints into timm-format hub folders, validate them, push them.

A hub folder holds ``model.safetensors`` (no pickles, ``{'format': 'pt'}`` metadata), ``config.json`` in the layout
of the ``timm/`` organisation's repositories (timm's ``save_config_for_hf``; ``model_args`` only for what the model
name cannot rebuild, never the loader arguments) and a ``README.md`` model card (``huggingface_hub.ModelCard`` from
``card_template.md``).  Everything is driven by
timm's registry: any ttt-zoo model registered with a pretrained tag can be converted, with the
``checkpoint_filter_fn`` beside it in its model file.  Checkpoints are read by :mod:`ttt_zoo.checkpoint`.

- :mod:`.folder`: reading, building, validating, loading (``PATH``, ``local-dir:``, ``hf-hub:``), pushing;
- :mod:`.convert`: checkpoint -> folder (written beside the target and swapped in: an old folder is never lost);
- :mod:`.cards`: model cards and the authors' reported numbers.

Command line: ``ttt-zoo convert`` / ``ttt-zoo push`` (:mod:`ttt_zoo.cli`).  Hub naming scheme:
``ttt-zoo/<model>.<tag>`` (``ttt_zoo.checkpoint.HUB_ORG``); a tag of one's own (``vit3_tiny.digits``) names one's
own weights, whose card states none of the authors' results.
"""
from .convert import convert_all, convert_checkpoint, default_checkpoint_dir
from .folder import (CARD_NAME, CONFIG_NAME, HUB_ORG, WEIGHTS_NAME, HubArchitecture, HubFolderError,
                     build_from_checkpoint, example_inputs, hub_repo_id, install_to_hub_cache, load_folder, measure,
                     push_folder, read_config, register_hub_architecture, registered_pretrained, validate_folder)

__all__ = [
    "HUB_ORG", "WEIGHTS_NAME", "CONFIG_NAME", "CARD_NAME", "HubFolderError", "HubArchitecture", "hub_repo_id",
    "registered_pretrained", "register_hub_architecture", "read_config", "build_from_checkpoint", "example_inputs",
    "measure", "convert_checkpoint", "convert_all", "default_checkpoint_dir", "load_folder", "validate_folder",
    "push_folder", "install_to_hub_cache",
]

