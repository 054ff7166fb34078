"""Registration of the dense backbones with mmdet / mmseg, and a safe mmengine checkpoint loader.

mmengine 0.10.7 reads checkpoints (``load_from``, ``resume``) with a bare ``torch.load``; under torch >= 2.6 that
is ``weights_only=True`` and fails on the logging objects mmengine itself pickles.  :func:`install_safe_loader`
replaces the local-file loader with ``torch.load(weights_only=True)`` plus an allow-list of the plain data
types mmengine writes (numpy arrays/scalars, ``HistoryBuffer``): no code from the file runs.  Files holding
anything else are refused with an error that names the one explicit opt-in for trusted files:
``tools/mm_train.py --trust-checkpoint`` (or :func:`allow_unsafe_checkpoints` in a script).
"""
from __future__ import annotations

import importlib
import os
import pickle
from typing import Any, List

import torch

from ttt_zoo.checkpoint import CheckpointError, safe_torch_load

from .dense import HViT3Dense, TimmDense

__all__ = ["install", "register", "install_safe_loader", "allow_unsafe_checkpoints", "mmengine_safe_globals",
           "OPENMMLAB", "openmmlab_missing", "toolbox_models"]

BACKBONES = {"TTTHViT3": HViT3Dense, "TTTTimm": TimmDense}
_UNSAFE = {"on": False}

#: what `make openmmlab` installs, by import name: why it is missing
OPENMMLAB = {"mmengine": "mmengine 0.10.7 is not installed", "pkg_resources": "mmengine needs setuptools < 82",
             "mmcv": "mmcv 2.1.0 is not installed", "mmdet": "mmdet 3.3.0 is not installed",
             "mmseg": "mmsegmentation 1.2.2 is not installed"}


def openmmlab_missing(module: str) -> str:
    """The message for a module of the OpenMMLab stack that cannot be imported: which, and ``make openmmlab``."""
    why = OPENMMLAB.get(module, f"{module} is not installed")
    return (f"no module named {module!r} ({why}; mmdet/mmseg training needs the OpenMMLab stack); run "
            f"`make openmmlab` (mmcv with its CPU ops, mmengine, mmdet, mmsegmentation), then this command again")


def toolbox_models(toolbox: str):
    """The ``MODELS`` registry of ``toolbox`` ('mmdet' / 'mmseg'); not installed: a ModuleNotFoundError that says
    ``make openmmlab``."""
    try:
        return importlib.import_module(f"{toolbox}.registry").MODELS
    except ModuleNotFoundError as e:
        top = (e.name or toolbox).split(".")[0]
        raise ModuleNotFoundError(openmmlab_missing(top), name=top) from e


def register(registry) -> None:
    """Add our backbones to an mmengine ``MODELS`` registry (idempotent)."""
    for name, cls in BACKBONES.items():
        if registry.get(name) is not cls:
            registry.register_module(name=name, module=cls, force=True)


def install(registry, also: str) -> None:
    """What an entry point does: register our backbones in its ``MODELS`` ``registry`` and in the ``also`` toolbox's
    (``'mmdet'`` / ``'mmseg'``) when that is installed, then make mmengine load checkpoints safely."""
    register(registry)
    try:
        other = importlib.import_module(f"{also}.registry").MODELS
    except ImportError:  # the other toolbox is optional here
        other = None
    if other is not None:
        register(other)
    install_safe_loader()


def mmengine_safe_globals() -> List[Any]:
    """Classes/functions an mmengine checkpoint may hold besides tensors and containers (all plain data)."""
    import numpy as np
    from mmengine.logging.history_buffer import HistoryBuffer
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    dtypes = [type(np.dtype(t)) for t in ("float64", "float32", "float16", "int64", "int32", "int16", "int8",
                                          "uint8", "bool")]
    return [HistoryBuffer, _reconstruct, scalar, np.ndarray, np.dtype, *dtypes, bytes,
            (_history_getattr, "builtins.getattr")]


def _history_getattr(obj: Any, name: str) -> Any:
    """``getattr`` restricted to HistoryBuffer's public statistics methods (pickled as bound methods)."""
    from mmengine.logging.history_buffer import HistoryBuffer
    if (obj is HistoryBuffer or isinstance(obj, HistoryBuffer)) and not name.startswith("_"):
        return getattr(obj, name)
    raise pickle.UnpicklingError(f"getattr({type(obj).__name__}, {name!r}) is not allowed in a checkpoint")


def _safe_load_from_local(filename: str, map_location=None):
    filename = os.path.expanduser(filename)
    if not os.path.isfile(filename):
        raise FileNotFoundError(f"{filename} can not be found.")
    if _UNSAFE["on"]:
        return torch.load(filename, map_location=map_location, weights_only=False)
    try:
        return safe_torch_load(filename, map_location=map_location, safe_globals=mmengine_safe_globals())
    except CheckpointError as e:
        trust = (" It is outside the safe allow-list of mmengine checkpoints; only for a file you trust, pass "
                 "--trust-checkpoint to tools/mm_train.py / tools/mm_test.py (or call "
                 "ttt_zoo.adapters.allow_unsafe_checkpoints())." if str(e).startswith("Refusing") else "")
        raise RuntimeError(f"{e}{trust}") from e


def install_safe_loader() -> None:
    """Make mmengine read local checkpoints with ``weights_only=True`` (idempotent)."""
    from mmengine.runner.checkpoint import CheckpointLoader
    CheckpointLoader.register_scheme(prefixes="", loader=_safe_load_from_local, force=True)


def allow_unsafe_checkpoints() -> None:
    """Explicit opt-in, for trusted files only: later mmengine checkpoint loads in this process unpickle
    arbitrary objects.  Never called on import."""
    install_safe_loader()
    _UNSAFE["on"] = True
