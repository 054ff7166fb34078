"""The front door's model registry: which timm models are ttt-zoo's, their families and kinds, and
:func:`create_model` with close-match hints.  Re-exported by ``ttt_zoo``."""

from typing import Optional

__all__ = ["create_model", "resolve_model_name", "list_zoo_models", "list_zoo_families", "is_diffusion_model",
           "is_variant_model", "VARIANT_SUFFIXES"]


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


def resolve_model_name(model_name: str, kind: Optional[str] = None, flag: str = "") -> str:
    """The one check of a model name a user gives (every command's ``--model`` and :func:`create_model`): a name
    timm knows (the zoo's included; ``hf-hub:`` / ``local-dir:`` names go to timm as they are), of ``kind``
    ('image' or 'diffusion', when given); else a :class:`~ttt_zoo.errors.UsageError` naming the close matches."""
    import difflib
    import timm
    from .errors import UsageError
    base = model_name.split(".")[0]
    what = f"{flag} {model_name!r}" if flag else f"model {model_name!r}"
    if model_name.startswith(("hf-hub:", "local-dir:")):
        return model_name
    zoo = list_zoo_models(include_diffusion=True)
    if not timm.is_model(base):
        close = difflib.get_close_matches(base, zoo, n=3) or difflib.get_close_matches(base, timm.list_models(), n=3)
        hint = f" (Did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise UsageError(f"{what} is not a registered model; give a registered name{hint}; `ttt-zoo list` shows "
                         f"the zoo's models (timm's are accepted too)")
    if kind is not None and (base in zoo and is_diffusion_model(base)) != (kind == "diffusion"):
        close = [n for n in list_zoo_families(include_diffusion=True).values()
                 if is_diffusion_model(n) == (kind == "diffusion")][:3]
        if kind == "diffusion":
            raise UsageError(f"{what} is not a diffusion model (forward(x, t, y)); give a DiT-family model, e.g. "
                             f"{', '.join(close)}")
        raise UsageError(f"{what} is a diffusion model (forward(x, t, y)); give an image model, e.g. "
                         f"{', '.join(close)}")
    return model_name


def create_model(model_name: str, pretrained: bool = False, **kwargs):
    """``timm.create_model`` with a helpful error (close matches) for an unknown model name."""
    import timm
    resolve_model_name(model_name)
    if not model_name.startswith("hf-hub:"):
        return timm.create_model(model_name, pretrained=pretrained, **kwargs)
    try:
        return timm.create_model(model_name, pretrained=pretrained, **kwargs)
    except OSError as e:  # the repo's config.json: offline without a cached copy, not found, no network
        from .checkpoint import hub_unavailable_error
        raise hub_unavailable_error(model_name[len("hf-hub:"):].split("@")[0], "config.json", e) from e
