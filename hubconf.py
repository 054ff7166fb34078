"""torch.hub entry points: ``torch.hub.load('<repo or path>', 'vit3_tiny', pretrained=False)`` for every model."""
dependencies = ["torch", "timm", "safetensors", "huggingface_hub"]

import timm  # noqa: E402

import ttt_zoo  # noqa: E402


def _entrypoint(name):
    def create(pretrained: bool = False, **kwargs):
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    create.__name__ = name
    create.__doc__ = f"{name} from ttt-zoo (timm registry). `pretrained=True` loads the released weights."
    return create


for _name in ttt_zoo.list_zoo_models():
    globals()[_name] = _entrypoint(_name)


def create(model_name: str, pretrained: bool = False, **kwargs):
    """Any ttt-zoo model by name (unknown names get a clear error with close matches)."""
    return ttt_zoo.create_model(model_name, pretrained=pretrained, **kwargs)
