"""ttt-zoo: Test-Time-Training vision backbones for timm.  Importing registers every model with timm."""
__version__ = "0.1.0"

from . import kernels  # noqa: F401  (ttt_zoo.kernels, shipped from the top-level kernels/ folder)
from . import layers, models  # noqa: F401
from .models import *  # noqa: F401,F403
from .linearize import linearize, param_groups  # noqa: E402  (ttt_zoo.linearize is the function)



def list_zoo_models():
    """Names of every model ttt_zoo registers with timm (timm records the registering module's short name)."""
    import timm
    from .models import MODEL_MODULES
    return sorted(n for m in MODEL_MODULES for n in timm.list_models(module=m))


__all__ = ["layers", "models", "kernels", "list_zoo_models", "linearize", "param_groups", "__version__"]
