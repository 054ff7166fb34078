"""The registry of the TTT ops' paths, the lowest module of the kernels: ``backend.py`` decides among the paths,
``verify.py`` checks the Triton path against the PyTorch one."""
from typing import Callable, Dict, Optional

__all__ = ["available_ops", "register_op"]

_OPS: Dict[str, Dict[str, Callable]] = {}


def register_op(name: str, torch_impl: Callable, triton_impl: Optional[Callable] = None,
                naive_impl: Optional[Callable] = None) -> None:
    """Register an op's paths: ``torch`` (required), ``triton`` (the custom op), ``torch_naive`` (the reference)."""
    _OPS[name] = {"torch": torch_impl, "torch_naive": naive_impl or torch_impl}
    if triton_impl is not None:
        _OPS[name]["triton"] = triton_impl


def available_ops() -> Dict[str, Dict[str, bool]]:
    return {n: {"torch": True, "torch_naive": impls["torch_naive"] is not impls["torch"], "triton": "triton" in impls}
            for n, impls in sorted(_OPS.items())}
