"""One dispatch point for every TTT op.

CUDA tensors use a Triton kernel when one is registered and Triton imports; CPU and meta tensors
use the PyTorch path.  ``backend=`` or the ``TTT_ZOO_BACKEND`` environment variable
(``auto`` | ``torch`` | ``torch_naive`` | ``triton``) forces a path:

- ``torch``: pure PyTorch with an analytic, recomputing backward (lean training memory; any device);
- ``torch_naive``: the plain reference, differentiated by autograd (stores every intermediate);
- ``triton``: the fused kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``).
"""

import os
from typing import Callable, Dict, Optional

import torch

_BACKENDS = ("auto", "torch", "torch_naive", "triton")
_TORCH_IMPLS: Dict[str, Callable] = {}
_TRITON_IMPLS: Dict[str, Callable] = {}
_NAIVE_IMPLS: Dict[str, Callable] = {}


def register_op(name: str, torch_impl: Callable, triton_impl: Optional[Callable] = None,
                naive_impl: Optional[Callable] = None) -> None:
    _TORCH_IMPLS[name] = torch_impl
    if triton_impl is not None:
        _TRITON_IMPLS[name] = triton_impl
    if naive_impl is not None:
        _NAIVE_IMPLS[name] = naive_impl


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    backend = backend or os.environ.get("TTT_ZOO_BACKEND", "auto")
    if backend not in _BACKENDS:
        raise ValueError(f"Unknown TTT backend {backend!r}; choose one of {_BACKENDS} "
                         f"(argument `backend=` or env TTT_ZOO_BACKEND).")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def get_op(name: str, device: torch.device, backend: Optional[str] = None) -> Callable:
    if name not in _TORCH_IMPLS:
        raise KeyError(f"Unknown TTT op {name!r}; registered: {sorted(_TORCH_IMPLS)}")
    chosen = resolve_backend(backend, device)
    if chosen == "torch_naive":
        return _NAIVE_IMPLS.get(name, _TORCH_IMPLS[name])
    if chosen == "triton":
        impl = _TRITON_IMPLS.get(name)
        if impl is not None:
            return impl
        if backend == "triton" or os.environ.get("TTT_ZOO_BACKEND") == "triton":
            raise RuntimeError(f"No Triton kernel is available for op {name!r} "
                               f"(Triton missing or kernel not implemented); use backend='torch'.")
    return _TORCH_IMPLS[name]


def available_ops() -> Dict[str, Dict[str, bool]]:
    return {n: {"torch": True, "torch_naive": n in _NAIVE_IMPLS, "triton": n in _TRITON_IMPLS}
            for n in sorted(_TORCH_IMPLS)}
