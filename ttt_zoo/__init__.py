"""ttt-zoo: Test-Time-Training vision backbones for timm.  Importing registers every model with timm."""
import importlib.util as _ilu
import os as _os
import sys as _sys

# In a source checkout (torch.hub, a git worktree, an editable install) the top-level kernels/ folder beside this
# package is ttt_zoo.kernels, so the checkout's own kernels run; an installed wheel ships it as ttt_zoo/kernels.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_src = _os.path.join(_root, "kernels")
# (Not when already imported: the console script parses before this file runs; see _ttt_zoo_cli.)
if (__name__ + ".kernels" not in _sys.modules and _os.path.isfile(_os.path.join(_root, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_src, "__init__.py"))):
    _spec = _ilu.spec_from_file_location(__name__ + ".kernels", _os.path.join(_src, "__init__.py"),
                                         submodule_search_locations=[_src])
    _mod = _ilu.module_from_spec(_spec)
    _sys.modules[__name__ + ".kernels"] = _mod
    _spec.loader.exec_module(_mod)

from ._version import __version__  # noqa: E402
from . import kernels  # noqa: F401,E402  (ttt_zoo.kernels, shipped from the top-level kernels/ folder)
from . import layers, models  # noqa: F401,E402
from .models import *  # noqa: F401,F403,E402
from .linearize import linearize, param_groups  # noqa: E402  (ttt_zoo.linearize is the function)
from .analysis import linear_attention  # noqa: E402  (the function; forms and maps in ttt_zoo.analysis)
from .registry import (VARIANT_SUFFIXES, create_model, is_diffusion_model, is_variant_model,  # noqa: E402
                       list_zoo_families, list_zoo_models)

__all__ = ["create_model", "layers", "models", "kernels", "list_zoo_models", "list_zoo_families", "is_diffusion_model",
           "is_variant_model", "VARIANT_SUFFIXES", "linearize", "param_groups", "linear_attention",
           "__version__"]
