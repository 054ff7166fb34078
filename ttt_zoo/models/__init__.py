from .vit3 import ViT3
from .hvit3 import HViT3, HViT3Backbone
from .t5 import T5

__all__ = ["ViT3", "HViT3", "HViT3Backbone", "T5"]

#: timm module names of our model files (timm.list_models(module=...))
MODEL_MODULES = ("vit3", "hvit3", "t5")
