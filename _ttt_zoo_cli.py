"""The ``ttt-zoo`` console script: parse the command line before ``ttt_zoo/__init__`` runs.

``import ttt_zoo`` imports torch and timm and registers every model (seconds).  The command parsers in
``ttt_zoo.cli`` import neither, so this entry creates the package without running its ``__init__``, lets
``ttt_zoo.cli.main`` parse (``--help`` and usage errors answer at once), and runs the ``__init__`` once the
arguments are good, before the command.  ``python -m ttt_zoo`` and ``from ttt_zoo.cli import main`` import the
package as usual (``tests/test_cli_help.py`` checks that no parser imports torch, timm or torchvision).
"""
import importlib.util
import sys


def main() -> int:
    if "ttt_zoo" in sys.modules:  # already imported in full
        from ttt_zoo.cli import main as run
        return run()
    spec = importlib.util.find_spec("ttt_zoo")
    package = importlib.util.module_from_spec(spec)  # the package, its __init__ not yet run
    sys.modules["ttt_zoo"] = package
    from ttt_zoo.cli import main as run
    return run(before_command=lambda: spec.loader.exec_module(package))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
