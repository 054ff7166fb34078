"""Shared by tools/mm_train.py and tools/mm_test.py: run mmdet's or mmseg's own tools/{train,test}.py.

The package is chosen from the config's ``default_scope`` ('mmdet' or 'mmseg').  ``--trust-checkpoint`` is the
one explicit opt-in to unpickling full mmengine checkpoints that hold more than the safe allow-list (see
``ttt_zoo.adapters._mm``); without it every checkpoint is read with ``weights_only=True``.
"""
import os
import runpy
import sys


def package_tool(config: str, tool: str) -> str:
    from mmengine.config import Config
    scope = Config.fromfile(config, import_custom_modules=False).get("default_scope")
    if scope not in ("mmdet", "mmseg"):
        raise SystemExit(f"{config}: default_scope must be 'mmdet' or 'mmseg' (from the mmdet::/mmseg:: base "
                         f"configs), got {scope!r}.")
    pkg = __import__(scope)
    path = os.path.join(os.path.dirname(pkg.__file__), ".mim", "tools", f"{tool}.py")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} not found: reinstall {scope} from its wheel (`make openmmlab`).")
    return path


def main(tool: str) -> None:
    argv = sys.argv[1:]
    if not argv or argv[0].startswith("-"):
        raise SystemExit(f"usage: tools/mm_{tool}.py CONFIG [args of mmdet/mmseg tools/{tool}.py] "
                         f"[--trust-checkpoint]")
    if "--trust-checkpoint" in argv:
        argv.remove("--trust-checkpoint")
        from ttt_zoo.adapters import allow_unsafe_checkpoints
        allow_unsafe_checkpoints()
    path = package_tool(argv[0], tool)
    sys.argv = [path] + argv
    runpy.run_path(path, run_name="__main__")
