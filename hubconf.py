"""torch.hub entry points: ``torch.hub.load('<github org>/<repo>', 'vit3_tiny', pretrained=True)``.

Every ttt-zoo model registered with timm is an entry point, plus ``create_model`` (any name, including
``hf-hub:ttt-zoo/<model>.<tag>`` and ``local-dir:PATH``; unknown names get close-match suggestions) and
``load_folder`` (converted hub folders, including the non-timm dense-prediction backbones).
"""
dependencies = ["torch", "timm", "huggingface_hub", "safetensors"]

import timm as _timm  # noqa: E402

import ttt_zoo as _ttt_zoo  # noqa: E402
from ttt_zoo.hub import load_folder  # noqa: E402,F401


def create_model(model_name: str, pretrained: bool = False, **kwargs):
    """``timm.create_model`` with the ttt-zoo models registered and a helpful unknown-name error."""
    return _ttt_zoo.create_model(model_name, pretrained=pretrained, **kwargs)


def _entry(name):
    def entry(pretrained: bool = False, **kwargs):
        return _timm.create_model(name, pretrained=pretrained, **kwargs)
    entry.__name__ = name
    entry.__doc__ = f"timm.create_model({name!r}, pretrained=pretrained, **kwargs)"
    return entry


for _name in _ttt_zoo.list_zoo_models(include_diffusion=True):
    globals()[_name] = _entry(_name)
