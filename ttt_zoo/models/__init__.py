from .vit3 import ViT3
from .hvit3 import HViT3, HViT3Backbone
from .dit import DiT
from . import dit3  # noqa: F401
from .dit5 import linearize_dit
from .t5 import T5
from .visionttt import VisionTTT, VisionTTTH, gradient_magnitude_map

__all__ = ["ViT3", "HViT3", "HViT3Backbone", "DiT", "linearize_dit", "T5", "VisionTTT", "VisionTTTH",
           "gradient_magnitude_map"]

#: timm module names of our model files (timm.list_models(module=...))
MODEL_MODULES = ("vit3", "hvit3", "t5", "visionttt", "dit", "dit3", "dit5")
#: the diffusion models among them: forward(x, t, y), not image classifiers, so timm's classifier test suite
#: (tools/timm_suite) cannot apply; list_zoo_models() leaves them out unless include_diffusion=True
DIFFUSION_MODULES = ("dit", "dit3", "dit5")
