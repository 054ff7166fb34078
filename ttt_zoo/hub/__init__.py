"""Hugging Face Hub support: convert checkpoints into timm-format hub folders, validate them, push them.

A hub folder holds ``model.safetensors`` (no pickles, ``{'format': 'pt'}`` metadata), ``config.json`` in the layout
of the ``timm/`` organisation's repositories (timm's ``save_config_for_hf``; ``model_args`` only for what the model
name cannot rebuild, never the loader arguments) and a ``README.md`` model card (``huggingface_hub.ModelCard`` from
``card_template.md``).  Everything is driven by
timm's registry: any ttt-zoo model registered with a pretrained tag can be converted, with the
``checkpoint_filter_fn`` beside it in its model file.  Checkpoints are read by :mod:`ttt_zoo.checkpoint`.

- :mod:`ttt_zoo.hub_format`: the format: every ``config.json`` key, its type, range, meaning and readers; the one
  writer and the one reader of ``config.json``; the weights' sha256 (``ttt_zoo.weights_sha256``);
- :mod:`.build`: the architectures a folder may hold, building a model from a checkpoint, measuring it;
- :mod:`.convert`: checkpoint -> folder (:mod:`.staging`: written beside the target and swapped in, an old folder
  is never lost; a symlink's target is replaced, the link kept);
- :mod:`.load`: loading (``PATH``, ``local-dir:``, ``hf-hub:``) and validating folders;
- :mod:`.publish`: pushing (``create_repo`` + ``upload_folder``) and installing into a Hugging Face cache;
- :mod:`.cards`: model cards and the authors' reported numbers.

Command line: ``ttt-zoo convert`` / ``ttt-zoo push`` (:mod:`ttt_zoo.cli`).  Hub naming scheme:
``ttt-zoo/<model>.<tag>`` (``ttt_zoo.checkpoint.HUB_ORG``); a tag of one's own (``vit3_tiny.digits``) names one's
own weights, whose card states none of the authors' results.
"""
from ttt_zoo.checkpoint import HUB_ORG
from ttt_zoo.errors import HubFolderError
from ttt_zoo.hub_format import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME

from .build import (HubArchitecture, build_from_checkpoint, example_inputs, hub_repo_id, measure,
                    register_hub_architecture, registered_pretrained)
from .convert import convert_all, convert_checkpoint, default_checkpoint_dir
from .load import load_folder, read_config, validate_folder
from .publish import install_to_hub_cache, push_folder
from .staging import staged_folder

__all__ = [
    "HUB_ORG", "WEIGHTS_NAME", "CONFIG_NAME", "CARD_NAME", "HubFolderError", "HubArchitecture", "hub_repo_id",
    "registered_pretrained", "register_hub_architecture", "read_config", "build_from_checkpoint", "example_inputs",
    "measure", "convert_checkpoint", "convert_all", "default_checkpoint_dir", "load_folder", "validate_folder",
    "push_folder", "install_to_hub_cache", "staged_folder",
]

