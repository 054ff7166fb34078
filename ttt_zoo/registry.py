"""The front door's model registry: which timm models are ttt-zoo's, their families and kinds, and
:func:`create_model` with close-match hints.  Re-exported by ``ttt_zoo``."""

__all__ = ["create_model", "list_zoo_models", "list_zoo_families", "is_diffusion_model", "is_variant_model",
           "VARIANT_SUFFIXES"]


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
