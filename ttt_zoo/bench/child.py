"""Entry point of one fresh measuring process: ``python -m ttt_zoo.bench.child KIND SPEC_JSON``.

Prints one line ``RESULT_TAG + json`` with the result; errors raise (the parent reports the traceback's end).
The spec's ``backend`` (the parent's ``--backend``) becomes the process-wide TTT op backend
(``ttt_zoo.kernels.backend.set_backend``); None leaves the default.
"""

import json
import os
import sys


def main(kind: str, spec_json: str) -> None:
    spec = json.loads(spec_json)
    import ttt_zoo  # registers the models
    if spec.get("src") and not os.path.abspath(ttt_zoo.__file__).startswith(os.path.abspath(spec["src"])):
        raise RuntimeError(f"ttt_zoo imported from {ttt_zoo.__file__}, not from {spec['src']}")
    import importlib
    for module in spec.get("imports") or ():  # --import: modules registering more models with timm
        importlib.import_module(module)
    if spec.get("backend") is not None:
        from ttt_zoo.kernels.backend import set_backend
        set_backend(spec["backend"])
    from .measure import RESULT_TAG
    if kind == "model":
        from .models import bench_model as fn
    elif kind == "profile":
        from .models import profile_model as fn
    elif kind == "ops":
        from .ops import bench_ops as fn
    else:
        raise ValueError(f"unknown benchmark kind {kind!r}")
    print(RESULT_TAG + json.dumps(fn(spec)), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
