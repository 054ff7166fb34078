"""The docs' claims about the code, read from the docs and checked against the code (issue 38, item 3).

- ``kernels/README.md``: its op table against the op registry (``backend.available_ops()``) and the op folders on
  disk, each op's wrapper in ``api.py``, and its line of ops with a current GPU record against
  ``kernels/gpu_verified.json``.
- ``docs/adding_a_mixer.md``: the files a new mixer touches.  The stated counts agree with the tables, the existing
  files of case (a) are exactly ``ttt_zoo/layers/__init__.py`` and the test files that walk the mixer registry, and
  a mixer registered from ``ttt_zoo.layers`` fails that walker until it is listed there.
"""
import contextlib
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KERNELS_README = ROOT / "kernels" / "README.md"
MIXER_DOC = ROOT / "docs" / "adding_a_mixer.md"
SOURCE_DIRS = ("ttt_zoo", "kernels", "tests", "tools", "experiments")


def table_after(text: str, start: str):
    """The body rows (lists of stripped cells) of the first Markdown table at or after the line starting ``start``."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(start))
    while not lines[i].startswith("|"):
        i += 1
    rows = []
    for line in lines[i + 2:]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def ticked(cell: str):
    return re.findall(r"`([^`]+)`", cell)


# ------------------------------------------------------------------------------------------- kernels/README.md
def test_kernels_readme_op_table_is_the_registry():
    """Every registered op has its row, in the folder its code lives in, and every op folder has a row; an op
    without a Triton kernel says "none" in the Triton column."""
    from ttt_zoo.kernels import available_ops, get_op
    rows = table_after(KERNELS_README.read_text(), "| op (registry name)")
    table = {op: (row[1].strip("`/"), row[3]) for row in rows for op in ticked(row[0])}
    ops = available_ops()
    assert sorted(table) == sorted(ops), "kernels/README.md's op table against backend.available_ops()"
    for op, (folder, triton_cell) in table.items():
        module = get_op(op, torch.device("cpu"), "torch").__module__  # ttt_zoo.kernels.<folder>.torch
        assert module.split(".")[2] == folder, (op, module, folder)
        assert triton_cell.startswith("none") == (not ops[op]["triton"]), (op, triton_cell)
    folders = {p.parent.name for p in (ROOT / "kernels").glob("*/__init__.py")}
    assert {folder for folder, _ in table.values()} == folders, "op folders on disk without a row, or rows without one"


def test_kernels_readme_wrappers_are_in_api_py():
    """The README: the layers call every op through one wrapper in ``api.py``."""
    from ttt_zoo.kernels import available_ops
    text = KERNELS_README.read_text()
    assert "one wrapper in `api.py`" in text
    api = (ROOT / "kernels" / "api.py").read_text()
    assert [op for op in available_ops() if f'_op("{op}"' not in api] == []


def test_kernels_readme_gpu_record_line_is_true():
    """The README's line of ops with a record matching their current kernel sources, against the shipped file."""
    from ttt_zoo.kernels import available_ops, backend
    line = re.search(r"\*\*Ops with a current GPU record: ([^*]*)\.\*\*", KERNELS_README.read_text()).group(1)
    stated = [] if line == "none" else ticked(line)
    records = json.loads((ROOT / "kernels" / "gpu_verified.json").read_text())
    current = sorted(op for op in available_ops()
                     if any(r["op"] == op and r["sha256"] == backend.kernel_source_hash(op) for r in records))
    assert sorted(stated) == current


# ------------------------------------------------------------------------------------- docs/adding_a_mixer.md
def _files_in_rows(rows):
    """{path: is new} of a doc table whose first cell is a row number or a range (``1-6``)."""
    return {path: "(new)" in row[1] for row in rows for path in ticked(row[1])}


WALK = re.compile(r"for \w+ in list_mixers\(\)")


def _walkers():
    """The source files that iterate over the mixer registry."""
    files = [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")]
    return {p.relative_to(ROOT).as_posix() for p in files if WALK.search(p.read_text(errors="replace"))}


@contextlib.contextmanager
def package_toy_mixer():
    """A mixer added the doc's way (a): registered from a module of ``ttt_zoo.layers``, no linear-attention form,
    no variant options."""
    from test_toy_mixer import ToyTTT

    from ttt_zoo.layers.mixer import _MIXERS, register_mixer
    register_mixer("doc_toy")(type("DocToyTTT", (ToyTTT,), {"__module__": "ttt_zoo.layers.doc_toy"}))
    try:
        yield "doc_toy"
    finally:
        del _MIXERS["doc_toy"]


def _walker_tests(path: str):
    """The argument-free test functions of a walker file that iterate over the registry."""
    module = importlib.import_module(Path(path).stem) if path.startswith("tests/") else None
    return [fn for name, fn in sorted(vars(module).items()) if name.startswith("test_") and callable(fn)
            and not inspect.signature(fn).parameters and WALK.search(inspect.getsource(fn))] if module else []


def _fails(fn) -> bool:
    try:
        fn()
    except AssertionError:
        return True
    return False


def _walkers_needing_an_edit():
    """The walker files with a test that passes today and fails once a new package mixer is registered."""
    walkers = sorted(_walkers())
    tests = {path: _walker_tests(path) for path in walkers}
    assert all(tests.values()), f"a walker this test cannot run (update tests/test_docs_truth.py): {tests}"
    for fns in tests.values():
        for fn in fns:
            fn()  # green before the new mixer
    with package_toy_mixer():
        return {path for path, fns in tests.items() if any(_fails(fn) for fn in fns)}


def test_adding_a_mixer_file_counts():
    doc = MIXER_DOC.read_text()
    a = _files_in_rows(table_after(doc, "### (a) A mixer alone"))
    n_a = int(re.search(r"### \(a\) A mixer alone: (\d+) files", doc).group(1))
    assert len(a) == n_a == int(re.search(r"\| \(a\) [^|]*\| files touched: (\d+)", doc).group(1))
    assert int(re.search(r"\| \(b\) [^|]*\| files touched: (\d+)", doc).group(1)) == n_a
    c_rows = table_after(doc, "### (c) With a fast kernel")
    n_c = sum(int(r[0].split("-")[-1]) - int(r[0].split("-")[0]) + 1 for r in c_rows)
    assert f"+{n_c} files ({n_a + n_c})" in doc
    assert int(re.search(r"\| \(c\) [^|]*\| files touched: (\d+) \(the (\d+) of \(a\) \+ (\d+)", doc).group(1)) \
        == n_a + n_c
    # the existing files a mixer touches: the package's import list, and every test that walks the registry
    existing = {path for path, new in a.items() if not new}
    assert existing == {"ttt_zoo/layers/__init__.py"} | _walkers_needing_an_edit()


def test_package_mixers_are_imported_by_layers_init():
    """Row 2 of (a): importing ``ttt_zoo`` registers a mixer because ``ttt_zoo/layers/__init__.py`` imports its
    module."""
    from ttt_zoo.layers.mixer import _MIXERS
    init = (ROOT / "ttt_zoo" / "layers" / "__init__.py").read_text()
    modules = {cls.__module__ for cls in _MIXERS.values() if cls.__module__.startswith("ttt_zoo.layers.")}
    assert modules and [m for m in modules if f"from .{m.rsplit('.', 1)[1]} import" not in init] == []


def test_a_new_package_mixer_fails_the_linear_attention_walker():
    """Row 4 of (a): a mixer added the doc's way makes the walker in ``tests/test_linear_attention.py`` fail,
    naming it, until that file lists it."""
    from test_linear_attention import test_every_registered_mixer_has_a_checked_form_or_says_it_has_none as walker
    with package_toy_mixer(), pytest.raises(AssertionError, match="doc_toy"):
        walker()
