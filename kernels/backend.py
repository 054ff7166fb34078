"""The one backend decision for every TTT op.

Every op wrapper (``kernels/api.py``) asks :func:`resolve_backend`, under the op's own name, which path to run, once
per call; a ``ttt_zoo::`` custom op is handed that choice as its last argument (``triton``) and its backward gets the
forward's.  No choice outlives its call.  Values, the same for every op and layer:

- ``auto`` (default): the Triton kernels for CUDA tensors where they can run (Triton installed, float32 / float16 /
  bfloat16, head dim within the kernel's limit) and only for ops verified on this GPU (``verify.verified``: a
  repository record, else the cached or first-use local check), else ``torch``;
- ``torch``: the lean PyTorch path with an analytic, recomputing backward (any device and dtype);
- ``torch_naive``: the plain reference, differentiated by autograd (stores every intermediate);
- ``triton``: the fused kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``, and the meta device for shapes).
  Where they cannot run, forcing ``triton`` raises :class:`BackendError` saying why (``auto`` falls back instead).

The process-wide default: :func:`set_backend` (or, inside a block, the :func:`use_backend` context manager, as timm's
``set_layer_config``), else the ``TTT_ZOO_BACKEND`` environment variable, read here only (at every call), else
``auto``; an explicit ``backend=`` argument wins.

GPU verification (``kernels/verify.py``): ``auto`` picks an op's kernel on CUDA only if ``gpu_verified.json`` (or
the file ``TTT_ZOO_GPU_RECORDS`` names) holds a record whose ``sha256`` equals the hash of the op's current kernel
sources, or the op's local check on this GPU passed (run once on first use, cached per GPU, torch, Triton, source
hash and dtype).  Forcing ``triton`` runs no check and ignores the records.
"""
import contextlib
import importlib.util
import os
from typing import Callable, Dict, Iterator, Optional

import torch
from timm.layers import is_exportable

# the GPU verification (records, kernel source hashes) lives in verify.py; re-exported here
from . import verify
from .registry import _OPS, available_ops, register_op  # the ops' paths (below this module and verify.py)
from .verify import (KERNELS_DIR, RECORDS_ENV, clear_verification_cache, gpu_verified, kernel_folder,
                     kernel_source_hash, kernel_sources, load_gpu_records, records_path)

__all__ = ["BACKENDS", "ENV_VAR", "BackendError", "HAS_TRITON", "MAX_HEAD_DIM", "RECORDS_ENV", "TRITON_BACKEND",
           "TRITON_DTYPES", "available_ops", "clear_verification_cache", "compiling", "default_backend", "exporting", "tracing",
           "get_op",
           "gpu_verified", "kernel_folder", "kernel_source_hash", "kernel_sources", "load_gpu_records", "records_path",
           "needs_grad", "register_op", "resolve_backend", "set_backend", "triton_choice", "triton_unsupported",
           "use_backend"]

from ttt_zoo.flags import BACKENDS, TRITON_BACKEND  # noqa: E402  (the names a command line gives)
ENV_VAR = "TTT_ZOO_BACKEND"
# Triton is optional and imported lazily by each op's ``triton.py`` (CPU users never pay for it; tests set
# TRITON_INTERPRET=1 before it is first imported)
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# per-op head-dim limit of the Triton kernels (ops not listed take any head dim).  TTT-Linear: two 128-padded
# d x d fp32 states per program would spill registers above 64.  T5 / DiT5: the d x d weights and partials of the
# backward pass go through shared memory, which on an H200 (sm_90, 227 KB a block) ran out from d = 48 in fp16
# (T5, 3 weights) and d = 72 (DiT5, 2 weights): ``OutOfResources`` in the lease of 2026-11-26
# (experiments/results/gpu_h200_20261126); ``experiments/compile_kernels.py`` reports each kernel's shared memory.
# ``vit3_qkv_fused``: the ViT3 mixer core's fused kernels (``vit3_ttt/fused.py``, whole d x d tiles per program; at
# 128 an sm_90 compile of hand-written signatures spilled and _bwd_update needed 311,296 bytes of shared memory);
# above it ``vit3_qkv_ttt`` runs the per-branch kernels, which take any head dim.
# The one table of the kernels' limits: every op folder's ``choose()`` reads it (through ``triton_unsupported``).
MAX_HEAD_DIM: Dict[str, int] = {"ttt_linear": 64, "ttt_linear_bidir": 64, "linear_attention_bidir": 64,
                                "t5_swiglu_ttt": 64, "dit5_mlp_ttt": 64, "vit3_qkv_fused": 64}


class BackendError(RuntimeError):
    """A forced backend cannot run this op on these inputs."""


_BACKEND_SET: Optional[str] = None  # set_backend's choice; None: TTT_ZOO_BACKEND or auto
_RESOLVE_SOURCES = f"argument `backend=`, set_backend or env {ENV_VAR}"


def _check_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"Unknown TTT backend {name!r}; choose one of {BACKENDS} ({where}).")
    return name


def default_backend() -> str:
    """The process-wide default: :func:`set_backend`'s choice, else ``TTT_ZOO_BACKEND`` (the only place the variable
    is read), else ``auto``."""
    return _BACKEND_SET or os.environ.get(ENV_VAR) or "auto"


def set_backend(name: Optional[str]) -> None:
    """Set the process-wide default backend of every TTT op (overrides ``TTT_ZOO_BACKEND``); ``None`` restores the
    environment variable / ``auto``."""
    global _BACKEND_SET
    _BACKEND_SET = None if name is None else _check_name(name, "set_backend")


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[None]:
    """``with use_backend("torch"): ...``: :func:`set_backend` inside the block, the previous setting restored on
    exit (also on an exception; nestable).  The restore keeps the kernel choices made inside, so a backward run
    after the block uses the same kernels as its forward."""
    global _BACKEND_SET
    previous = _BACKEND_SET
    set_backend(name)
    try:
        yield
    finally:
        _BACKEND_SET = previous


def exporting() -> bool:
    """A graph is being exported: torch.export (the dynamo ONNX exporter), torch.jit.trace (the TorchScript ONNX
    exporter), or timm's ``exportable`` flag is set (``timm.layers.set_layer_config(exportable=True)``).  The one
    export decision: ``auto`` runs PyTorch, and the ops that branch on it (the ViT3 ops) run a path both exporters
    trace (no autograd.Function, no strided view, no grouped conv with a traced group count)."""
    return torch.compiler.is_exporting() or torch.jit.is_tracing() or is_exportable()


def tracing() -> bool:
    """A graph is being captured (torch.compile, torch.export, torch.jit.trace, timm's ``exportable``): eager-only
    shortcuts (cached constants, strided ``out=`` buffers, complex views) give way to forms every tracer takes."""
    return torch.compiler.is_compiling() or exporting()


def compiling() -> bool:
    """Inside torch.compile but not torch.export: the ops' choosers then hand dynamo opaque custom ops (export keeps
    every op traceable, for ONNX)."""
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def needs_grad(*ts) -> bool:
    """Autograd will differentiate through these inputs (else an op may take its inference path)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def triton_choice(t: torch.Tensor, op: str, head_dim: Optional[int]) -> bool:
    """The ``triton`` argument of an op's custom-op entry called directly without one (``triton=None``; the choosers
    pass theirs): whether the kernels can run these inputs under ``op``'s own name (:func:`triton_unsupported`)."""
    return triton_unsupported(t.device, t.dtype, head_dim, op) is None


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unsupported(device: torch.device, dtype: Optional[torch.dtype] = None, head_dim: Optional[int] = None,
                       op: Optional[str] = None) -> Optional[str]:
    """Why the Triton kernels cannot run here, or None when they can."""
    if op is not None and op in _OPS and "triton" not in _OPS[op]:
        return f"op {op!r} has no Triton kernel"
    if not HAS_TRITON:
        return "Triton is not installed (pip install 'ttt-zoo[triton]')"
    if device.type == "cpu" and not _interpreter_on():
        return "the tensors are on the CPU (set TRITON_INTERPRET=1 before importing triton to run the kernels " \
               "in the Triton interpreter)"
    if device.type not in ("cuda", "cpu", "meta"):
        return f"there are no Triton kernels for {device.type} tensors"
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"the kernels take float32, float16 or bfloat16 inputs, got {dtype}"
    limit = MAX_HEAD_DIM.get(op or "")
    if limit is not None and head_dim is not None and head_dim > limit:
        return f"head dim {head_dim} is above the kernel's limit of {limit}"
    return None


def resolve_backend(backend: Optional[str], device: torch.device, dtype: Optional[torch.dtype] = None,
                    head_dim: Optional[int] = None, op: Optional[str] = None) -> str:
    """The path to run: ``torch``, ``torch_naive`` or ``triton``, from the argument, the process default
    (:func:`default_backend`), the device, the dtype and the head dim.  Raises for an unknown name, or a forced ``triton`` that cannot run."""
    requested = _check_name(backend if backend is not None else default_backend(), _RESOLVE_SOURCES)
    if requested in ("torch", "torch_naive"):
        return requested
    reason = triton_unsupported(device, dtype, head_dim, op)
    if requested == TRITON_BACKEND:
        if reason is not None:
            what = f"op {op!r}" if op else "this op"
            raise BackendError(f"backend='triton' cannot run {what}: {reason}. Use backend='auto' (falls back to "
                               f"PyTorch) or backend='torch'.")
    elif reason is not None or device.type != "cuda" or exporting() or not verify.verified(op, device, dtype):
        return "torch"  # auto: the kernels only on CUDA, and only where verified there
    return TRITON_BACKEND


def get_op(name: str, device: torch.device, backend: Optional[str] = None, dtype: Optional[torch.dtype] = None,
           head_dim: Optional[int] = None) -> Callable:
    """The implementation of op ``name`` that :func:`resolve_backend` picks."""
    if name not in _OPS:
        raise KeyError(f"Unknown TTT op {name!r}; registered: {sorted(_OPS)}")
    return _OPS[name][resolve_backend(backend, device, dtype, head_dim, name)]

