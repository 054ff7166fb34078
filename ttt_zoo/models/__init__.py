"""The model families.  Every public module of this package is a family file: importing the package imports them
all, which registers their models with timm, so a new family is its file alone."""
import importlib as _importlib
import pkgutil as _pkgutil

#: timm module names of our model files (timm.list_models(module=...)): every module not starting with "_"
MODEL_MODULES = tuple(sorted(m.name for m in _pkgutil.iter_modules(__path__) if not m.name.startswith("_")))
for _m in MODEL_MODULES:
    _importlib.import_module(f"{__name__}.{_m}")

from .vit3 import ViT3  # noqa: E402
from .hvit3 import HViT3, HViT3Backbone, HVIT3_SIZES  # noqa: E402
from .dit import DiT  # noqa: E402
from .t5 import T5  # noqa: E402
from .visionttt import VisionTTT, VisionTTTH, gradient_magnitude_map  # noqa: E402

__all__ = ["ViT3", "HViT3", "HViT3Backbone", "HVIT3_SIZES", "DiT", "T5", "VisionTTT", "VisionTTTH",
           "gradient_magnitude_map"]
