"""pytest plugin of ``tools/gpu_check.py`` (``-p pytest_collected``, with ``tools`` on ``PYTHONPATH``).

- ``PYTEST_COLLECTED_FILE=PATH``: the ids of the tests that will run (after ``-k``), one a line, written as soon as
  collection ends, so that a run cut off later still tells what it was meant to run (a GPU record needs every
  collected case of its op run and passed);
- ``PYTEST_FIRST_N=N``: keep only the first N of them (the lease script's CPU dry run: one case per file).
"""
import os

import pytest


@pytest.hookimpl(trylast=True)  # after -k / -m deselected theirs
def pytest_collection_modifyitems(config, items):
    n = os.environ.get("PYTEST_FIRST_N")
    if n and len(items) > int(n):
        config.hook.pytest_deselected(items=items[int(n):])
        del items[int(n):]


def pytest_collection_finish(session):
    path = os.environ.get("PYTEST_COLLECTED_FILE")
    if not path or not session.items:  # an xdist controller collects nothing: its workers write the list
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(item.nodeid.split("::", 1)[-1] + "\n" for item in session.items))
    os.replace(tmp, path)
