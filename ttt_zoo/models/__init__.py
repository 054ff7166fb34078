from .vit3 import ViT3
from .hvit3 import HViT3, HViT3Backbone
from .visionttt import VisionTTT, VisionTTTH, gradient_magnitude_map

__all__ = ["ViT3", "HViT3", "HViT3Backbone", "VisionTTT", "VisionTTTH", "gradient_magnitude_map"]

#: timm module names of our model files (timm.list_models(module=...))
MODEL_MODULES = ("vit3", "hvit3", "visionttt")
