"""Helpers shared by every op folder: compute dtype, autocast control, autograd glue, lazy Triton import."""
import contextlib
import importlib
from types import ModuleType

import torch

__all__ = ["compute_dtype", "no_autocast", "autocast_state", "reduce_to", "needs_grad", "triton_module"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Inner updates accumulate in float32 unless the input is already float32/float64."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def no_autocast(device: torch.device, enabled: bool = False, dtype=None):
    """Autocast context for ``device``: off by default (the inner steps choose their own precision); ``enabled``
    replays a saved autocast state (:func:`autocast_state`)."""
    if device.type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    if not enabled:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def autocast_state(device: torch.device):
    if device.type not in ("cpu", "cuda"):
        return False, None
    return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def reduce_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum a per-sample weight gradient over the batch when the weight was shared (leading dim 1)."""
    if like.shape[0] == 1 and t.shape[0] != 1:
        t = t.sum(0, keepdim=True)
    return t


def needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def triton_module(package: str) -> ModuleType:
    """``<package>.triton``, imported on first use (CPU users never import Triton)."""
    return importlib.import_module(".triton", package)
