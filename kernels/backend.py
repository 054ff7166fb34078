"""The one backend decision for every TTT op.

Every op wrapper (``kernels/__init__.py``) asks :func:`resolve_backend` which path to run, and every custom op asks
:func:`use_triton` (the same rule) whether its kernel may run Triton.  Values, the same for every op and layer:

- ``auto`` (default): the Triton kernels for CUDA tensors where they can run (Triton installed, float32 / float16 /
  bfloat16, head dim within the kernel's limit), else ``torch``;
- ``torch``: the lean PyTorch path with an analytic, recomputing backward (any device and dtype);
- ``torch_naive``: the plain reference, differentiated by autograd (stores every intermediate);
- ``triton``: the fused kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``, and the meta device for shapes).
  Where they cannot run, forcing ``triton`` raises :class:`BackendError` saying why (``auto`` falls back instead).

The process-wide default comes from the ``TTT_ZOO_BACKEND`` environment variable, read here only (at every call,
so benchmarks can switch it); an explicit ``backend=`` argument wins.
"""
import importlib.util
import os
from typing import Callable, Dict, Optional

import torch

__all__ = ["BACKENDS", "ENV_VAR", "BackendError", "HAS_TRITON", "MAX_HEAD_DIM", "TRITON_DTYPES", "available_ops",
           "default_backend", "get_op", "register_op", "resolve_backend", "triton_unsupported", "use_triton"]

BACKENDS = ("auto", "torch", "torch_naive", "triton")
ENV_VAR = "TTT_ZOO_BACKEND"
# Triton is optional and imported lazily by each op's ``triton.py`` (CPU users never pay for it; tests set
# TRITON_INTERPRET=1 before it is first imported)
HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# per-op head-dim limit of the Triton kernels (ops not listed take any head dim).  TTT-Linear: two 128-padded
# d x d fp32 states per program would spill registers above 64.
MAX_HEAD_DIM: Dict[str, int] = {"ttt_linear": 64, "ttt_linear_bidir": 64}


class BackendError(RuntimeError):
    """A forced backend cannot run this op on these inputs."""


_OPS: Dict[str, Dict[str, Callable]] = {}


def register_op(name: str, torch_impl: Callable, triton_impl: Optional[Callable] = None,
                naive_impl: Optional[Callable] = None) -> None:
    """Register an op's paths: ``torch`` (required), ``triton`` (the custom op), ``torch_naive`` (the reference)."""
    _OPS[name] = {"torch": torch_impl, "torch_naive": naive_impl or torch_impl}
    if triton_impl is not None:
        _OPS[name]["triton"] = triton_impl


def default_backend() -> str:
    """The process-wide default: ``TTT_ZOO_BACKEND`` or ``auto`` (the only place the variable is read)."""
    return os.environ.get(ENV_VAR) or "auto"


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
    """The path to run: ``torch``, ``torch_naive`` or ``triton``, from the argument, the environment default, the
    device, the dtype and the head dim.  Raises for an unknown name, or a forced ``triton`` that cannot run."""
    requested = backend if backend is not None else default_backend()
    if requested not in BACKENDS:
        raise ValueError(f"Unknown TTT backend {requested!r}; choose one of {BACKENDS} "
                         f"(argument `backend=` or env {ENV_VAR}).")
    if requested in ("torch", "torch_naive"):
        return requested
    reason = triton_unsupported(device, dtype, head_dim, op)
    if requested == "triton":
        if reason is not None:
            what = f"op {op!r}" if op else "this op"
            raise BackendError(f"backend='triton' cannot run {what}: {reason}. Use backend='auto' (falls back to "
                               f"PyTorch) or backend='torch'.")
        return "triton"
    return "triton" if reason is None and device.type == "cuda" else "torch"


def use_triton(t: torch.Tensor, op: Optional[str] = None) -> bool:
    """Inside a custom op: run the Triton kernel for these inputs (same rule as :func:`resolve_backend`; an empty
    batch needs no kernel launch, the meta device only the fake impl)."""
    return t.numel() > 0 and t.device.type != "meta" and triton_unsupported(t.device, t.dtype, t.shape[-1], op) is None


def get_op(name: str, device: torch.device, backend: Optional[str] = None, dtype: Optional[torch.dtype] = None,
           head_dim: Optional[int] = None) -> Callable:
    """The implementation of op ``name`` that :func:`resolve_backend` picks."""
    if name not in _OPS:
        raise KeyError(f"Unknown TTT op {name!r}; registered: {sorted(_OPS)}")
    return _OPS[name][resolve_backend(backend, device, dtype, head_dim, name)]


def available_ops() -> Dict[str, Dict[str, bool]]:
    return {n: {"torch": True, "torch_naive": impls["torch_naive"] is not impls["torch"], "triton": "triton" in impls}
            for n, impls in sorted(_OPS.items())}
