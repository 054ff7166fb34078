"""Verification of the Triton kernels: which ops ``auto`` runs through their kernel on this GPU (:func:`verified`).

1. A repository record: ``gpu_verified.json`` (next to this file, or the file ``TTT_ZOO_GPU_RECORDS`` names) holds
   a record for the op whose ``sha256`` equals the hash of the op's current kernel sources (its folder's Triton
   modules, the module of its Triton path, and every package module they import or load, transitively; see
   :func:`kernel_sources`).  Editing a kernel
   changes the hash, so its record no longer matches.  ``tools/gpu_check.py`` writes the records on a lent GPU.
2. Else a local check, made where the op runs (:func:`check_op`): on the op's first use on a GPU (or on demand,
   ``ttt-zoo kernels --verify``) its Triton path is run against its PyTorch path on that device, forward and every
   input gradient, at the shapes of :data:`CASES` (a long sequence, an odd size, the timing shape) within
   :data:`TOL`; then both paths are timed at the timing shape and the faster runs.  The result is cached in the
   user's cache folder (:func:`cache_path`), keyed by device name, torch and Triton versions, the op's source hash
   and the dtype, so it runs once.  A failed check warns once and PyTorch runs.

No check runs while torch.compile traces, while a graph is exported (torch.export, torch.jit), under timm's
``exportable`` flag or while a CUDA graph is captured: there only the records and the cache count, else PyTorch
runs.  Forcing a backend (``backend=``, ``set_backend``, ``TTT_ZOO_BACKEND``) never runs a check.
"""
import ast
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from timm.layers import is_exportable

from ttt_zoo.fileio import atomic_write

from .registry import _OPS

RECORDS_ENV = "TTT_ZOO_GPU_RECORDS"  # path of the GPU verification records (default: gpu_verified.json here)
CACHE_ENV = "TTT_ZOO_CACHE"  # the user's cache folder of the local checks (default: $XDG_CACHE_HOME/ttt_zoo)
REPORT_HOW = "please attach the output of `ttt-zoo kernels --verify --json` to an issue of ttt-zoo"
KERNELS_DIR = Path(__file__).resolve().parent  # the installed ttt_zoo.kernels folder
_PACKAGE = "ttt_zoo.kernels"


# ------------------------------------------------------------------------------------------- GPU verification
_HASHES: Dict[tuple, Optional[str]] = {}  # (kernels dir, op) -> sha256, once per process
_RECORDS: Dict[str, List[dict]] = {}      # records file -> its records, read once per process


def kernel_folder(op: Optional[str]) -> Optional[str]:
    """The folder under ``kernels/`` of ``op``'s Triton kernel (from the module of its registered implementation),
    or None (unknown op, no kernel, or registered from outside this package)."""
    impl = _OPS.get(op or "", {}).get("triton")
    parts = (getattr(impl, "__module__", None) or "").split(".")
    return parts[2] if parts[:2] == _PACKAGE.split(".") and len(parts) > 2 else None


def _triton_modules(folder: Path) -> List[Path]:
    """The modules of an op folder that import Triton (``triton.py``, ``vit3_ttt/fused.py``, ...)."""
    return [f for f in sorted(folder.glob("*.py")) if re.search(r"^(import|from) triton\b", f.read_text(), re.M)]


def _imported_files(path: Path, root: Path) -> List[Path]:
    """The package's files that ``path`` imports relatively (``from .x import a``, ``from .. import y``), and its
    folder's Triton modules where it loads them at run time (``utils.triton_module(__package__)``)."""
    pkg = list(path.relative_to(root).parent.parts)
    text = path.read_text()
    found = _triton_modules(path.parent) if "triton_module(__package__)" in text else []
    for node in ast.walk(ast.parse(text, str(path))):
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
    triton, e.g. ``vit3_ttt/fused.py``), the module of its registered Triton path, and every module of the package
    they import, transitively (``triton_utils.py``, the folder's ``torch.py`` glue, another folder's kernels an op
    runs: ``linear_attention_bidir`` runs ``ttt_linear/``'s, ...); empty without a kernel."""
    root = Path(root) if root is not None else KERNELS_DIR
    folder = kernel_folder(op)
    if not folder:
        return []
    impl = root.joinpath(*_OPS[op]["triton"].__module__.split(".")[2:]).with_suffix(".py")
    todo = _triton_modules(root / folder) + ([impl] if impl.is_file() else [])
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
    key = (str(root), op)
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
    """Forget the cached hashes, records and local checks read (for tests: a new process starts this way)."""
    _HASHES.clear()
    _RECORDS.clear()
    _LOCAL.clear()
    _DECIDED.clear()


# ------------------------------------------------------------------------------------------------ local check
# max |triton - torch| / max |torch| of the output and of every input gradient, the Triton path run in its dtype
# against the PyTorch path in float32 on float32 copies of the same (rounded) data.  The one table: the local check
# and tests/test_kernels_cuda.py (run by tools/gpu_check.py for the repository records) read it.
TOL: Dict[torch.dtype, float] = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _heads(n_w: int, extra: Callable[[int], tuple]):
    """q, k, v (B, heads, N, d) and ``n_w`` inner weights (1, heads, d, d): ViT3 SwiGLU, T5, DiT5."""
    def build(shape, rnd):
        b, h, n, d = shape
        return [rnd(b, h, n, d) for _ in range(3)] + [rnd(1, h, d, d, scale=0.02, weight=True)
                                                      for _ in range(n_w)] + list(extra(d))
    return build


def _dwconv(shape, rnd):
    b, d, hh, ww = shape
    return [rnd(b, d, hh, ww) for _ in range(3)] + [rnd(d, 1, 3, 3, scale=0.02, weight=True), d ** -0.5, True]


def _qkv(shape, rnd):
    b, heads, hh, ww, d = shape
    c = heads * d
    return [rnd(b, hh * ww, c), rnd(3 * c + 3 * d, c, scale=c ** -0.5), rnd(3 * c + 3 * d, scale=0.02),
            rnd(1, heads, d, d, scale=0.02, weight=True), rnd(1, heads, d, d, scale=0.02, weight=True),
            rnd(d, 1, 3, 3, scale=0.02, weight=True), (hh, ww), heads, d ** -0.5, True, None, None]


def _variant(shape, rnd):
    return _qkv(shape, rnd) + [False, 1.0, False, 1]


def _key_norm(shape, rnd):
    b, n, c = shape
    return [rnd(b, n, c), 1.0]


def _residual_dwconv(shape, rnd):
    b, w, n, c = shape  # N = H W tokens of a map W wide
    return [rnd(b, n, c), rnd(c, 1, 3, 3, scale=0.3, weight=True), rnd(c, scale=0.1, weight=True), (n // w, w), "gelu"]


def _adaln(shape, rnd):
    b, n, c = shape  # x, y (B, N, C) and the (B, 3, C) shift / scale / gate (strided views inside)
    return [rnd(b, n, c, shift=0.5), rnd(b, n, c), rnd(b, 3, c, scale=0.1), 1e-6]


def _mlp_gelu(shape, rnd):
    b, n, c = shape  # an fc1 output (B, N, C) and an fc2 weight (64, C); the tanh form, as DiT's MLP
    return [rnd(b, n, c, scale=2.0, shift=0.3), rnd(64, c, scale=c ** -0.5, weight=True), "tanh"]


def _scan_state(shape, rnd):
    b, h, n, d, mb = shape
    return [rnd(b, h, n, d) for _ in range(3)] + [rnd(b, h, n, scale=1.0 / d, uniform=True),
                                                  rnd(mb, uniform=True, shift=0.5), rnd(1, h, d, d, scale=0.02),
                                                  rnd(1, h, 1, d, scale=0.02)]


def _ttt_linear(bidir: bool):
    def build(shape, rnd):
        d, mb = shape[3], shape[4]
        ln = [rnd(shape[1], d, scale=0.1, shift=1.0), rnd(shape[1], d, scale=0.1)]
        return _scan_state(shape, rnd) + ln + ([mb, True, 10000.0, 1e-6, False] if bidir else [mb, True, 1e-6, False])
    return build


def _linear_attention(shape, rnd):
    return _scan_state(shape, rnd) + [shape[4]]


def _linear_attention_bidir(shape, rnd):
    """As the layer calls it: lr as logits (rate 1/d sigmoid), tau as offsets, the state and offsets in float32."""
    b, h, n, d, mb = shape
    return [rnd(b, h, n, d) for _ in range(3)] + [rnd(b, h, n), rnd(mb, scale=0.1, weight=True),
                                                  rnd(1, h, d, d, scale=0.02, weight=True),
                                                  rnd(1, h, 1, d, scale=0.02, weight=True), mb, 10000.0, 1.0 / d, True]


# shapes: heads ops (B, heads, N, d); dwconv (B, d, H, W); qkv (B, heads, H, W, d); key norm and adaLN (B, N, C);
# scans (B, heads, N, d, mini_batch); residual dwconv (B, W, N = H W, C).  GPU: a long sequence (N in the
# thousands), odd sizes, and last the timing shape (a training batch of the models' size); the interpreter (CPU): one
# small odd shape.  Every head dim is within the op's kernel limit (backend.MAX_HEAD_DIM; tests/test_kernel_verify.py
# checks).
_HEADS = [(1, 2, 8192, 64), (1, 2, 8192, 32), (2, 3, 999, 24), (8, 6, 1024, 32)]
_QKV = [(1, 3, 64, 128, 64), (2, 2, 15, 13, 24), (8, 3, 28, 28, 64)]
_SCAN = [(1, 2, 8192, 64, 16), (2, 2, 999, 32, 16), (8, 3, 1024, 64, 16)]
CASES: Dict[str, Tuple[Callable, List[tuple], List[tuple]]] = {  # op -> (input builder, GPU shapes, CPU shapes)
    "vit3_swiglu_ttt": (_heads(2, lambda d: (d ** -0.5, True)), _HEADS, [(1, 2, 21, 16)]),
    "vit3_dwconv_ttt": (_dwconv, [(1, 64, 96, 96), (2, 8, 33, 31), (8, 192, 28, 28)], [(1, 4, 5, 7)]),
    "vit3_qkv_ttt": (_qkv, _QKV, [(1, 2, 4, 3, 8)]),
    "vit3_variant_qkv_ttt": (_variant, _QKV, [(1, 2, 4, 3, 8)]),
    "t5_swiglu_ttt": (_heads(3, lambda d: (d ** -0.5,)), _HEADS, [(1, 2, 21, 16)]),
    "dit5_mlp_ttt": (_heads(2, lambda d: (d ** -0.5,)), _HEADS, [(1, 2, 21, 16)]),
    "key_instance_norm": (_key_norm, [(1, 8192, 192), (2, 999, 72), (8, 1024, 192)], [(2, 9, 12)]),
    "residual_dwconv3x3": (_residual_dwconv, [(1, 64, 4096, 64), (2, 37, 999, 24), (8, 28, 784, 192)],
                           [(1, 5, 35, 12)]),
    "adaln_modulate": (_adaln, [(1, 8192, 1152), (8, 256, 1152), (2, 999, 384), (32, 1024, 384)], [(2, 9, 24)]),
    "mlp_gelu": (_mlp_gelu, [(1, 8192, 1536), (2, 999, 72), (32, 256, 1536)], [(2, 9, 24)]),
    "ttt_linear": (_ttt_linear(False), _SCAN, [(1, 1, 21, 16, 8)]),
    "ttt_linear_bidir": (_ttt_linear(True), _SCAN, [(1, 1, 21, 16, 8)]),
    "linear_attention": (_linear_attention, _SCAN, [(1, 1, 21, 16, 8)]),
    "linear_attention_bidir": (_linear_attention_bidir, _SCAN, [(1, 1, 21, 16, 8)]),
}
HEAD_DIM_AT = {"ttt_linear": 3, "ttt_linear_bidir": 3, "linear_attention": 3, "linear_attention_bidir": 3,
               "vit3_dwconv_ttt": 1}  # else the last


def case_shapes(op: str, device: torch.device) -> List[tuple]:
    """The shapes ``op`` is checked at on ``device`` (a GPU, or the interpreter); the last one is the timing shape."""
    return list(CASES[op][1] if device.type == "cuda" else CASES[op][2]) if op in CASES else []


def case_inputs(op: str, shape: tuple, device: torch.device, dtype: torch.dtype, seed: int = 0) -> list:
    """``op``'s positional inputs at ``shape``: activations in ``dtype``, inner weights in float32 as the layers keep
    them; tensors are leaves that require grad.  Drawn from a CPU generator (the global RNG is left alone)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*size, scale=1.0, shift=0.0, weight=False, uniform=False):
        t = (torch.rand(*size, generator=g) if uniform else torch.randn(*size, generator=g)) * scale + shift
        return t.to(device, torch.float32 if weight else dtype).requires_grad_()
    return CASES[op][0](shape, rnd)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def compare_paths(op: str, new: list, ref: list, dtype: torch.dtype) -> Tuple[float, str]:
    """The largest relative error of ``op``'s Triton path on ``new`` against its PyTorch path on ``ref`` (float32
    copies), over the output and every input gradient, and what it was measured on."""
    out = _first(_OPS[op]["triton"](*new))
    expected = _first(_OPS[op]["torch"](*ref))
    if out.dtype != dtype or out.shape != expected.shape:
        raise ValueError(f"output {out.dtype} {tuple(out.shape)}, expected {dtype} {tuple(expected.shape)}")
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to(expected.device)
    leaves = [i for i, t in enumerate(new) if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out, [new[i] for i in leaves], grad_out.to(dtype), allow_unused=True)
    ref_grads = torch.autograd.grad(expected, [ref[i] for i in leaves], grad_out, allow_unused=True)
    worst, where = 0.0, "output"
    for name, a, b in [("output", out, expected)] + [(f"gradient of input {i}", a, b)
                                                    for i, a, b in zip(leaves, grads, ref_grads)]:
        if b is None:
            continue
        if a is None or a.shape != b.shape:
            return float("inf"), f"{name} missing or of the wrong shape"
        err = ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
        if not err <= worst:  # NaN counts as the worst
            worst, where = err, name
    return worst, where


def _time_ms(op: str, backend: str, inputs: list, dtype: torch.dtype) -> float:
    """Median time of a forward + backward of ``op``'s ``backend`` path (torch.utils.benchmark: CUDA-synchronised)."""
    from torch.utils.benchmark import Timer
    fn = _OPS[op][backend]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        out = _first(fn(*inputs))
        torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
    step()  # compile / autotune outside the timing
    return Timer("step()", globals={"step": step}).blocked_autorange(min_run_time=0.2).median * 1e3


_CHECKING = [False]  # a check is running (an op's paths may call other ops: those are not checked inside it)


def check_op(op: str, device: torch.device, dtype: Optional[torch.dtype] = None, shapes: Optional[Sequence] = None,
             timing: Optional[bool] = None) -> dict:
    """Check ``op``'s Triton path against its PyTorch path on ``device`` now, then time both at the timing shape (on
    CUDA; ``timing`` overrides) and choose; stores the result in the cache and returns it (:func:`cache_entry`)."""
    dtype = dtype or torch.float32
    shapes = list(shapes) if shapes is not None else case_shapes(op, device)
    timing = device.type == "cuda" if timing is None else timing
    entry = dict(check_key(op, device, dtype), passed=False, error=None, tol=TOL[dtype], case=None, ms=None)
    previous, _CHECKING[0] = _CHECKING[0], True
    try:
        no_autocast = torch.autocast(device.type, enabled=False) if torch.is_autocast_enabled(device.type) \
            else contextlib.nullcontext()
        with torch.inference_mode(False), torch.enable_grad(), no_autocast:
            if not shapes:
                raise ValueError(f"no check cases for op {op!r} (add them to CASES in {__file__})")
            worst = (0.0, None)
            for shape in shapes:
                new = case_inputs(op, shape, device, dtype)
                ref = [t.detach().float().requires_grad_() if isinstance(t, torch.Tensor) else t for t in new]
                err, where = compare_paths(op, new, ref, dtype)
                if not err <= worst[0]:
                    worst = (err, f"{'x'.join(map(str, shape))} {where}")
                if not err <= TOL[dtype]:
                    break
            entry.update(error=worst[0], case=worst[1], passed=worst[0] <= TOL[dtype])
            if entry["passed"] and timing:
                inputs = case_inputs(op, shapes[-1], device, dtype)
                entry["ms"] = {b: round(_time_ms(op, b, inputs, dtype), 4) for b in ("triton", "torch")}
    except Exception as e:  # a kernel that does not compile or run here fails its check
        entry.update(error=float("inf"), case=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    finally:
        _CHECKING[0] = previous
    if not entry["passed"]:
        entry.update(choice="torch", why=f"local check failed: {_failure(entry)}")
    elif entry["ms"] is None:
        entry.update(choice="torch", why="local check passed (not timed: PyTorch runs off CUDA)")
    else:
        faster = "triton" if entry["ms"]["triton"] <= entry["ms"]["torch"] else "torch"
        entry.update(choice=faster, why=f"local check passed; {faster} faster "
                                        f"({entry['ms']['triton']:.3g} vs {entry['ms']['torch']:.3g} ms)")
    _store(entry)
    return entry


def _failure(entry: dict) -> str:
    if entry["error"] == float("inf"):
        return entry["case"]
    return f"relative error {entry['error']:.2e} > {entry['tol']:.0e} ({entry['case']})"


# ------------------------------------------------------------------------------------------------ the cache
_LOCAL: Dict[str, Dict[str, dict]] = {}  # cache file -> {key: entry}, read once per process
_DECIDED: Dict[tuple, bool] = {}  # (op, device, dtype) -> verified(), once decided (versions and sources are fixed)


def cache_path() -> Path:
    """The local checks' cache: ``$TTT_ZOO_CACHE``, else ``$XDG_CACHE_HOME/ttt_zoo``, else ``~/.cache/ttt_zoo``,
    file ``kernel_checks.json``."""
    folder = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ttt_zoo")
    return Path(folder) / "kernel_checks.json"


def device_name(device: torch.device) -> Optional[str]:
    """The GPU's name (the cache key), ``cpu (Triton interpreter)`` on the CPU; None for a CUDA device this process
    cannot reach (then nothing is checked: CUDA is never initialised for a decision alone)."""
    if device.type != "cuda":
        return f"{device.type} (Triton interpreter)"
    return torch.cuda.get_device_name(device) if torch.cuda.is_available() else None


@functools.lru_cache(maxsize=None)
def triton_version() -> Optional[str]:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_key(op: str, device: torch.device, dtype: torch.dtype) -> dict:
    """What a local check's result holds for: the device name, torch and Triton versions, the op, its kernel source
    hash and the dtype (any change means a new check)."""
    return dict(device=device_name(device), torch=str(torch.__version__), triton=triton_version(), op=op,
                sha256=kernel_source_hash(op), dtype=str(dtype).replace("torch.", ""))


def _key_text(key: dict) -> str:
    return json.dumps([key[k] for k in ("device", "torch", "triton", "op", "sha256", "dtype")])


def _read_cache(path: Path) -> Dict[str, dict]:
    """The cache file's entries by key (none if it is missing); ValueError if it is not a cache."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
            raise ValueError("not a JSON list of objects")
        return {_key_text(e): e for e in data}
    except KeyError as e:
        raise ValueError(f"an entry without {e}") from None


def _cache() -> Dict[str, dict]:
    path = cache_path()
    if str(path) not in _LOCAL:
        try:
            _LOCAL[str(path)] = _read_cache(path)
        except ValueError as e:
            warnings.warn(f"ignoring the kernel check cache {path} ({e}); the kernels are checked again")
            _LOCAL[str(path)] = {}
    return _LOCAL[str(path)]


def cache_entry(op: str, device: torch.device, dtype: Optional[torch.dtype]) -> Optional[dict]:
    """The cached local check of ``op`` on ``device`` in ``dtype`` for the current versions and sources, or None."""
    return _cache().get(_key_text(check_key(op, device, dtype or torch.float32)))


def _store(entry: dict) -> None:
    """Add ``entry`` to the cache file (merged with what other processes wrote meanwhile; written atomically)."""
    path = cache_path()
    entries = _cache()
    try:
        entries.update(_read_cache(path))  # what other processes wrote meanwhile
    except (ValueError, OSError):
        pass  # a corrupt file (warned about when read) is rewritten whole
    entries[_key_text(entry)] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(str(path), json.dumps(list(entries.values()), indent=1) + "\n")
    except OSError as e:  # a read-only home: the result holds for this process
        warnings.warn(f"could not write the kernel check cache {path} ({e}); set {CACHE_ENV} to a writable folder")


def checks_allowed() -> bool:
    """Not while torch.compile traces, a graph is exported or scripted, timm's ``exportable`` flag is set, or a CUDA
    graph is being captured (a check launches and synchronises)."""
    return not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()
                or torch.jit.is_scripting() or is_exportable() or _CHECKING[0]
                or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()))


@torch.compiler.assume_constant_result  # as gpu_verified: decided once while torch.compile traces, a constant after
def verified(op: Optional[str], device: torch.device, dtype: Optional[torch.dtype]) -> bool:
    """``auto`` runs ``op``'s Triton kernel on ``device`` for ``dtype``: a repository record matches its sources, else
    the cached local check chose it, else (first use, outside compile and export) the check runs now."""
    memo = (op, str(device), dtype)
    if memo in _DECIDED:
        return _DECIDED[memo]
    if op is None or kernel_source_hash(op) is None:
        return False
    if gpu_verified(op):
        _DECIDED[memo] = True
        return True
    if device_name(device) is None:  # a CUDA device this process cannot reach (tests): nothing to check on
        return False
    entry = cache_entry(op, device, dtype)
    if entry is None:
        if not checks_allowed():
            return False  # PyTorch now; decided again outside compile / export
        entry = check_op(op, device, dtype)
        if not entry["passed"]:
            warnings.warn(f"ttt_zoo: the Triton kernel of {op} failed its check on {entry['device']} "
                          f"({entry['dtype']}): {_failure(entry)}; PyTorch runs instead. To report it, {REPORT_HOW}.",
                          stacklevel=2)
    _DECIDED[memo] = entry.get("choice") == "triton"
    return _DECIDED[memo]
