"""Layers that only look down: every import of the package (``ttt_zoo/`` and ``kernels/``, which is
``ttt_zoo.kernels``), at the top of a module or inside a function, goes to the importer's own floor or one below,
and no modules import each other in a circle.  The floors are README.md's "Layout"; this table is their one
definition."""
import ast
import fnmatch
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]

#: the floors, lowest first: a module may import from its own floor and those below it, never from one above.
#: A file's floor is that of the first pattern (its path in the repository, fnmatch: ``*`` spans folders) it
#: matches, so a new file in a folder needs no entry here; a new top-level module does (the test names it).
FLOORS: List[Tuple[str, Tuple[str, ...]]] = [
    ("errors", ("ttt_zoo/errors.py", "ttt_zoo/_version.py")),          # the error types, the version
    ("fileio", ("ttt_zoo/fileio.py", "ttt_zoo/flags.py", "ttt_zoo/finite.py", "ttt_zoo/images.py",
                "ttt_zoo/progress.py")),  # ground tools
    ("files and ops", ("ttt_zoo/checkpoint.py", "ttt_zoo/run_folder/*", "ttt_zoo/hub_format.py", "kernels/*")),
    ("layers", ("ttt_zoo/layers/*",)),                                   # the mixers, the block
    ("models", ("ttt_zoo/models/*", "ttt_zoo/registry.py")),             # the families, the zoo's registry
    ("model tools", ("ttt_zoo/analysis/*", "ttt_zoo/export.py", "ttt_zoo/sampling.py", "ttt_zoo/torchcompile.py")),
    ("formats and conversions", ("ttt_zoo/hub/*", "ttt_zoo/linearize/*", "ttt_zoo/sd3/*")),
    ("package", ("ttt_zoo/__init__.py",)),                               # `import ttt_zoo`: re-exports only
    ("applications", ("ttt_zoo/train/*", "ttt_zoo/bench/*", "ttt_zoo/adapters/*")),
    ("cli", ("ttt_zoo/cli/*", "ttt_zoo/__main__.py")),                   # the top: the `ttt-zoo` commands
]

#: upward imports still allowed, ``(importer file, imported module): why``; none today
EXEMPT: Dict[Tuple[str, str], str] = {}


def floor_of(path: str, floors=FLOORS) -> Optional[int]:
    return next((i for i, (_, pats) in enumerate(floors) if any(fnmatch.fnmatch(path, p) for p in pats)), None)


def module_name(path: str) -> Tuple[str, bool]:
    """Repository path -> (dotted module name, is a package ``__init__``); ``kernels/`` is ``ttt_zoo.kernels``."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[0] == "kernels":
        parts.insert(0, "ttt_zoo")
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def package_sources(root: Path = ROOT) -> Dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8")
            for base in ("ttt_zoo", "kernels") for p in sorted((root / base).rglob("*.py"))}


def _dynamic_target(node: ast.Call, me: str) -> Optional[str]:
    """The module of ``importlib.import_module("a.b")``; ``"a.*"`` for ``import_module(f"a.{x}")``: the public
    modules of ``a`` (``ttt_zoo/cli/__init__`` imports each command's module so, ``models/__init__`` each family's)."""
    f = node.func
    if not (getattr(f, "attr", None) == "import_module" or getattr(f, "id", None) == "import_module") or not node.args:
        return None
    a = node.args[0]
    if isinstance(a, ast.Constant) and isinstance(a.value, str):
        return a.value
    if isinstance(a, ast.JoinedStr) and a.values:
        prefix = ""
        for v in a.values:
            if isinstance(v, ast.Constant):
                prefix += v.value
            elif isinstance(v, ast.FormattedValue) and getattr(v.value, "id", None) == "__name__" and not prefix:
                prefix = me
            else:  # a name made at run time: the public modules of the package it is in
                return prefix.rpartition(".")[0] + ".*" if "." in prefix else None
        return prefix
    return None


def import_graph(sources: Dict[str, str]) -> Dict[str, List[Tuple[str, str, int]]]:
    """``{module: [(imported module, file, line), ...]}`` over the package's own modules: every ``import`` and
    ``from ... import`` anywhere in a file (relative ones resolved; ``from pkg import name`` is the submodule
    ``pkg.name`` where there is one, else ``pkg``), ``importlib.import_module`` of a fixed name, and the
    packages an import runs on the way (``import a.b.c`` runs ``a/b/__init__``), except the top-level package:
    each of its modules runs ``ttt_zoo/__init__`` first, and that file only re-exports."""
    mods = {module_name(path)[0]: path for path in sources}

    def resolve(name: str) -> Optional[str]:
        if name == "kernels" or name.startswith("kernels."):
            name = "ttt_zoo." + name
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: Dict[str, List[Tuple[str, str, int]]] = {m: [] for m in mods}
    for path, text in sources.items():
        me, is_pkg = module_name(path)
        package = me if is_pkg else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(text, filename=path)):
            names: List[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] +
                                    ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [f"{base}.{a.name}" if resolve(f"{base}.{a.name}") == f"{base}.{a.name}" else base
                         for a in node.names]
            elif isinstance(node, ast.Call):
                name = _dynamic_target(node, me) or ""
                names = [name]
                if name.endswith(".*"):
                    names = sorted(m for m in mods if m.startswith(name[:-1]) and not m[len(name) - 1:].startswith("_"))
            for name in names:
                if name.split(".")[0] not in ("ttt_zoo", "kernels"):
                    continue
                target = resolve(name)
                if target is None:
                    continue
                parts = target.split(".")
                on_the_way = [".".join(parts[:i]) for i in range(2, len(parts))]  # ttt_zoo.a for ttt_zoo.a.b
                for t in [p for p in on_the_way if p in mods and not me.startswith(p + ".")] + [target]:
                    if t != me:
                        graph[me].append((t, path, node.lineno))
    return graph


def upward_imports(graph, sources: Iterable[str], floors=FLOORS, exempt=EXEMPT) -> List[str]:
    """One line per import from a higher floor (``file:line: importer (floor) imports module (floor)``), and one
    per file of no floor."""
    path_of = {module_name(p)[0]: p for p in sources}
    out = [f"{p}: no floor: add its pattern to FLOORS in tests/test_import_layers.py"
           for p in path_of.values() if floor_of(p, floors) is None]
    for me, edges in graph.items():
        mine = floor_of(path_of[me], floors)
        for t, path, line in edges:
            theirs = floor_of(path_of[t], floors)
            if None not in (mine, theirs) and theirs > mine and (path, t) not in exempt:
                out.append(f"{path}:{line}: {me} (floor {floors[mine][0]!r}) imports {t} "
                           f"(floor {floors[theirs][0]!r}, higher)")
    return sorted(set(out))


def import_circles(graph) -> List[str]:
    """One line per circle of modules (Tarjan's strongly connected components, each shown as one closed path)."""
    succ = {m: sorted({t for t, _, _ in edges}) for m, edges in graph.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    comps: List[List[str]] = []

    def visit(v: str) -> None:  # recursive: the package is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:  # the shortest way back to the first module, inside the component
        start, inside = comp[0], set(comp)
        prev: Dict[str, str] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in succ[v]:
                    if w in inside and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while path[-1] != start or len(path) == 1:
            path.append(prev[path[-1]])
        path.reverse()
        where = [next(f"{p}:{ln}" for t, p, ln in graph[a] if t == b) for a, b in zip(path, path[1:])]
        out.append(f"import circle of {len(comp)} modules: {' -> '.join(path)} (at {', '.join(where)})")
    return out


def test_no_import_from_a_higher_floor():
    sources = package_sources()
    bad = upward_imports(import_graph(sources), sources)
    assert not bad, "imports from a higher floor:\n" + "\n".join(bad)


def test_no_import_circle():
    bad = import_circles(import_graph(package_sources()))
    assert not bad, "\n".join(bad)


def test_exemptions_are_still_needed():
    sources = package_sources()
    graph = import_graph(sources)
    used = {(p, t) for edges in graph.values() for t, p, _ in edges}
    assert not set(EXEMPT) - used, f"exemptions no import needs any more: {sorted(set(EXEMPT) - used)}"


def test_checker_finds_fileio_importing_cli():
    """The negative control: a lazy import of ``ttt_zoo.cli`` in ``fileio`` (the circle issue 38 found) is named,
    file and line, as an upward import and as a circle; a new top-level module without a floor is named too."""
    sources = {
        "ttt_zoo/__init__.py": "",
        "ttt_zoo/errors.py": "class UsageError(Exception):\n    pass\n",
        "ttt_zoo/fileio.py": "import os\n\n\ndef lock():\n    from .cli._common import UsageError\n",
        "ttt_zoo/cli/__init__.py": ("import importlib\n\nfor name in ('train',):\n"
                                    "    importlib.import_module(f'{__name__}.{name}')\n"),
        "ttt_zoo/cli/_common.py": "from ttt_zoo.errors import UsageError\n",
        "ttt_zoo/cli/train.py": "from ttt_zoo import fileio\n",
        "ttt_zoo/newthing.py": "from . import errors\n",
    }
    graph = import_graph(sources)
    assert ("ttt_zoo.cli", "ttt_zoo/fileio.py", 5) in graph["ttt_zoo.fileio"]  # the package the import runs
    assert upward_imports(graph, sources) == [
        "ttt_zoo/fileio.py:5: ttt_zoo.fileio (floor 'fileio') imports ttt_zoo.cli (floor 'cli', higher)",
        "ttt_zoo/fileio.py:5: ttt_zoo.fileio (floor 'fileio') imports ttt_zoo.cli._common (floor 'cli', higher)",
        "ttt_zoo/newthing.py: no floor: add its pattern to FLOORS in tests/test_import_layers.py"]
    assert import_circles(graph) == [
        "import circle of 3 modules: ttt_zoo.cli -> ttt_zoo.cli.train -> ttt_zoo.fileio -> ttt_zoo.cli "
        "(at ttt_zoo/cli/__init__.py:4, ttt_zoo/cli/train.py:1, ttt_zoo/fileio.py:5)"]
    del sources["ttt_zoo/newthing.py"]
    sources["ttt_zoo/fileio.py"] = "import os\n\nfrom .errors import UsageError\n"
    graph = import_graph(sources)
    assert upward_imports(graph, sources) == [] and import_circles(graph) == []


def test_readme_layout_names_the_same_floors():
    """README.md's "Layout" numbers the floors as FLOORS does, each with the same files and folders."""
    text = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Layout\n", 1)[1].split("\n\n", 1)[0]
    items = re.split(r"(?:^|\s)(\d+)\. ", text)[1:]
    readme = {int(n): {s for s in re.findall(r"`([^`]+)`", body) if s.endswith((".py", "/"))}
              for n, body in zip(items[::2], items[1::2])}

    def short(pattern: str) -> str:  # 'ttt_zoo/hub/*' -> 'hub/'; the package's own ttt_zoo/__init__.py stays
        top = pattern.startswith("ttt_zoo/") and pattern != "ttt_zoo/__init__.py"
        return (pattern[len("ttt_zoo/"):] if top else pattern).rstrip("*")
    assert readme == {i + 1: {short(p) for p in pats} for i, (_, pats) in enumerate(FLOORS)}
