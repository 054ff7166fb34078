"""TTT ops (installed as ``ttt_zoo.kernels``): one folder per op with its reference and kernels; the op functions
live in ``api.py``."""
import importlib as _importlib
import sys as _sys

if __name__ == "ttt_zoo.kernels":
    from . import api as _api

    globals().update({k: v for k, v in vars(_api).items() if not k.startswith("__")})
    __all__ = list(_api.__all__)
else:
    # This folder was imported by its bare name: a source checkout's root is on sys.path (``python -m pytest`` from
    # the checkout), and transformers imports any package named ``kernels`` to read its version.  A second copy
    # would register every ``ttt_zoo::*`` custom op again, so that the ops ran this copy's kernel modules instead
    # of ``ttt_zoo.kernels``'; the bare name is the one package instead.
    _sys.modules[__name__] = _importlib.import_module("ttt_zoo.kernels")
