"""ttt-zoo: Test-Time-Training vision backbones for timm.  Importing registers every model with timm."""
__version__ = "0.1.0"

from . import kernels  # noqa: F401  (ttt_zoo.kernels, shipped from the top-level kernels/ folder)
from . import layers, models  # noqa: F401
from .models import *  # noqa: F401,F403



def list_zoo_models(include_diffusion: bool = False):
    """Names of the models ttt_zoo registers with timm (timm records the registering module's short name).

    By default the image models only (what timm's own test suite checks); ``include_diffusion=True`` adds the
    diffusion transformers (dit, dit3, dit5), whose forward is ``(x, t, y)``."""
    import timm
    from .models import DIFFUSION_MODULES, MODEL_MODULES
    modules = [m for m in MODEL_MODULES if include_diffusion or m not in DIFFUSION_MODULES]
    return sorted(n for m in modules for n in timm.list_models(module=m))


__all__ = ["layers", "models", "kernels", "list_zoo_models", "__version__"]
