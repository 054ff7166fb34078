"""ttt-zoo: Test-Time-Training vision backbones for timm.  Importing registers every model with timm."""
__version__ = "0.1.0"

import importlib.util as _ilu
import os as _os
import sys as _sys

# In a source checkout (torch.hub, a git worktree, an editable install) the top-level kernels/ folder beside this
# package is ttt_zoo.kernels, so the checkout's own kernels run; an installed wheel ships it as ttt_zoo/kernels.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
_src = _os.path.join(_root, "kernels")
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isfile(_os.path.join(_src, "__init__.py")):
    _spec = _ilu.spec_from_file_location(__name__ + ".kernels", _os.path.join(_src, "__init__.py"),
                                         submodule_search_locations=[_src])
    _mod = _ilu.module_from_spec(_spec)
    _sys.modules[__name__ + ".kernels"] = _mod
    _spec.loader.exec_module(_mod)

from . import kernels  # noqa: F401,E402  (ttt_zoo.kernels, shipped from the top-level kernels/ folder)
from . import layers, models  # noqa: F401,E402
from .models import *  # noqa: F401,F403,E402
from .linearize import linearize, param_groups  # noqa: E402  (ttt_zoo.linearize is the function)
from .analysis import linear_attention  # noqa: E402  (the function; forms and maps in ttt_zoo.analysis)



def is_diffusion_model(model_name: str) -> bool:
    """True for the diffusion transformers (``forward(x, t, y)``): their pretrained cfg names no classifier."""
    import timm
    return timm.models.get_pretrained_cfg(model_name.split(".")[0]).classifier is None


#: name endings of the paper-variant models ("TTT with KV binding is secretly linear attention": ViT3 Table 2
#: variants ``*_v1/_v3/_v6``, Vision-TTT as plain linear attention ``*_la``); each runs its base model's code
VARIANT_SUFFIXES = ("_v1", "_v3", "_v6", "_la")


def is_variant_model(model_name: str) -> bool:
    """True for a paper-variant model (e.g. ``vit3_tiny_v1``), False for the papers' own models."""
    return model_name.split(".")[0].endswith(VARIANT_SUFFIXES)


def list_zoo_models(include_diffusion: bool = False, include_variants: bool = True):
    """Names of the models ttt_zoo registers with timm (timm records the registering module's short name).

    By default the image models only (what timm's own test suite checks); ``include_diffusion=True`` adds the
    diffusion transformers (dit, dit3, dit5), whose forward is ``(x, t, y)``; ``include_variants=False`` leaves
    out the paper-variant models (:data:`VARIANT_SUFFIXES`)."""
    import timm
    from .models import MODEL_MODULES
    names = sorted(n for m in MODEL_MODULES for n in timm.list_models(module=m))
    if not include_variants:
        names = [n for n in names if not is_variant_model(n)]
    return names if include_diffusion else [n for n in names if not is_diffusion_model(n)]


#: size names in the order of growing models (``*_tiny`` < ``*_s_*`` < ... < ``*_xl_*``)
_SIZES = ("tiny", "s", "small", "b", "base", "l", "large", "xl")


def list_zoo_families(include_diffusion: bool = False):
    """``{family: its smallest model}``, derived from the registry: the family is the name before the size
    (``t5_plus_tiny`` -> ``t5_plus``, ``dit3_s_2`` -> ``dit3``), the smallest model the one of the first size
    (then the shortest name: ``dit_s_2`` before ``dit_s_4``)."""
    out = {}
    for name in list_zoo_models(include_diffusion, include_variants=False):
        parts = name.split("_")
        i = next((j for j, p in enumerate(parts) if p in _SIZES), len(parts))
        family = "_".join(parts[:i])
        rank = (_SIZES.index(parts[i]) if i < len(parts) else len(_SIZES), len(name), name)
        if family not in out or rank < out[family][0]:
            out[family] = (rank, name)
    return {f: n for f, (_, n) in sorted(out.items())}


def create_model(model_name: str, pretrained: bool = False, **kwargs):
    """``timm.create_model`` with a helpful error (close matches) for an unknown ttt-zoo model name."""
    import difflib
    import timm
    base = model_name.split(".")[0]
    if not model_name.startswith(("hf-hub:", "local-dir:")) and base not in timm.list_models():
        close = difflib.get_close_matches(base, list_zoo_models(include_diffusion=True), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"Unknown model {model_name!r}.{hint} Run `ttt-zoo list` for every registered model.")
    if not model_name.startswith("hf-hub:"):
        return timm.create_model(model_name, pretrained=pretrained, **kwargs)
    try:
        return timm.create_model(model_name, pretrained=pretrained, **kwargs)
    except OSError as e:  # the repo's config.json: offline without a cached copy, not found, no network
        from .checkpoint import hub_unavailable_error
        raise hub_unavailable_error(model_name[len("hf-hub:"):].split("@")[0], "config.json", e) from e


__all__ = ["create_model", "layers", "models", "kernels", "list_zoo_models", "list_zoo_families", "is_diffusion_model",
           "is_variant_model", "VARIANT_SUFFIXES", "linearize", "param_groups", "linear_attention",
           "__version__"]
