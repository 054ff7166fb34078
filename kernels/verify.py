"""GPU verification of the Triton kernels: which ops ``auto`` may run on CUDA.

``auto`` picks an op's kernel on CUDA only if ``gpu_verified.json`` (next to this file, or the file
``TTT_ZOO_GPU_RECORDS`` names) holds a record for the op whose ``sha256`` equals the hash of the op's current kernel
sources (its folder's ``triton.py`` and every package module that imports, transitively; see :func:`kernel_sources`).
Editing a kernel changes the hash, so its record no longer matches.  ``tools/gpu_check.py`` writes the records after
the kernel tests pass on a GPU.  Forcing ``triton`` ignores the records.
"""
import ast
import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch

RECORDS_ENV = "TTT_ZOO_GPU_RECORDS"  # path of the GPU verification records (default: gpu_verified.json here)
KERNELS_DIR = Path(__file__).resolve().parent  # the installed ttt_zoo.kernels folder
_PACKAGE = "ttt_zoo.kernels"


def _registered_ops() -> Dict[str, dict]:
    from .backend import _OPS  # backend imports this module: read its registry at call time
    return _OPS


# ------------------------------------------------------------------------------------------- GPU verification
_HASHES: Dict[tuple, Optional[str]] = {}  # (kernels dir, op folder) -> sha256, once per process
_RECORDS: Dict[str, List[dict]] = {}      # records file -> its records, read once per process


def kernel_folder(op: Optional[str]) -> Optional[str]:
    """The folder under ``kernels/`` of ``op``'s Triton kernel (from the module of its registered implementation),
    or None (unknown op, no kernel, or registered from outside this package)."""
    impl = _registered_ops().get(op or "", {}).get("triton")
    parts = (getattr(impl, "__module__", None) or "").split(".")
    return parts[2] if parts[:2] == _PACKAGE.split(".") and len(parts) > 2 else None


def _imported_files(path: Path, root: Path) -> List[Path]:
    """The package's files that ``path`` imports relatively (``from .x import a``, ``from .. import y``)."""
    pkg = list(path.relative_to(root).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        target = root.joinpath(*pkg[:len(pkg) - node.level + 1], *(node.module.split(".") if node.module else []))
        if target.with_suffix(".py").is_file():
            found.append(target.with_suffix(".py"))
        elif target.is_dir():  # `from package import module`
            found += [target / f"{a.name}.py" for a in node.names if (target / f"{a.name}.py").is_file()]
    return found


def kernel_sources(op: str, root: Optional[Path] = None) -> List[Path]:
    """The files ``op``'s kernel is built from: its folder's Triton modules (``triton.py`` and any other that imports
    triton, e.g. ``vit3_ttt/fused.py``) and every module of the package they import, transitively
    (``triton_utils.py``, the folder's ``torch.py`` glue, ...); empty without a kernel."""
    root = Path(root) if root is not None else KERNELS_DIR
    folder = kernel_folder(op)
    todo = [f for f in sorted((root / folder).glob("*.py"))
            if re.search(r"^(import|from) triton\b", f.read_text(), re.M)] if folder else []
    seen = set()
    while todo:
        f = todo.pop()
        if f not in seen and f.name not in ("__init__.py", "backend.py"):
            seen.add(f)
            todo += _imported_files(f, root)
    return sorted(seen, key=lambda f: f.relative_to(root).as_posix())


def kernel_source_hash(op: str, root: Optional[Path] = None) -> Optional[str]:
    """sha256 over the relative paths and bytes of :func:`kernel_sources` (once per process), None without."""
    root = Path(root) if root is not None else KERNELS_DIR
    key = (str(root), kernel_folder(op))
    if key not in _HASHES:
        files = kernel_sources(op, root)
        h = hashlib.sha256()
        for f in files:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
        _HASHES[key] = h.hexdigest() if files else None
    return _HASHES[key]


def records_path() -> Path:
    """The GPU verification records: ``$TTT_ZOO_GPU_RECORDS``, else ``gpu_verified.json`` in the kernels folder."""
    return Path(os.environ.get(RECORDS_ENV) or KERNELS_DIR / "gpu_verified.json")


def load_gpu_records(path: Optional[Path] = None) -> List[dict]:
    """The records, a JSON list of objects (read once per process); a missing file holds none, an unreadable one
    warns and holds none (so ``auto`` runs PyTorch)."""
    path = Path(path) if path is not None else records_path()
    if str(path) not in _RECORDS:
        records: List[dict] = []
        if path.is_file():
            try:
                records = json.loads(path.read_text())
                if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
                    raise ValueError("not a JSON list of objects")
            except ValueError as e:
                warnings.warn(f"ignoring the GPU verification records in {path}: {e}")
                records = []
        _RECORDS[str(path)] = records
    return _RECORDS[str(path)]


@torch.compiler.assume_constant_result  # file reads: torch.compile runs it once while tracing, a constant after
def gpu_verified(op: Optional[str]) -> bool:
    """A record for ``op`` matches its current kernel sources."""
    digest = kernel_source_hash(op) if op else None
    return digest is not None and any(r.get("op") == op and r.get("sha256") == digest for r in load_gpu_records())


def clear_verification_cache() -> None:
    """Forget the cached hashes and records (for tests: a new process starts this way)."""
    _HASHES.clear()
    _RECORDS.clear()


@torch.compiler.assume_constant_result  # as gpu_verified: decided once while torch.compile traces, a constant after
def verified(op: Optional[str], device: torch.device, dtype: Optional[torch.dtype]) -> bool:
    """``auto`` may run ``op``'s Triton kernel on ``device`` for ``dtype``: a repository record matches its sources."""
    return gpu_verified(op)
