"""Helpers shared by every op folder: compute dtype, autocast control, autograd glue, lazy Triton import."""
import contextlib
import importlib
from types import ModuleType
from typing import Callable, Dict, Hashable, TypeVar

import torch

from .backend import needs_grad  # noqa: F401  (defined with the other path decisions)

__all__ = ["compute_dtype", "no_autocast", "autocast_state", "reduce_to", "needs_grad", "make_function",
           "triton_module", "count_flops_as", "launches_kernel", "launch_on_meta", "cached_constant"]

_T = TypeVar("_T")


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


def cached_constant(cache: Dict[Hashable, _T], key: Hashable, build: Callable[[], _T], max_entries: int = 32) -> _T:
    """``cache[key]``, built by ``build()`` on a miss: eager-mode constants (tables, identity taps) keyed by everything
    they depend on, so never stale.  Built as plain tensors whatever mode the first call ran in (a training step may
    save them for backward after an ``inference_mode`` call); the oldest entry goes past ``max_entries``."""
    hit = cache.get(key)
    if hit is None:
        with torch.inference_mode(False), torch.no_grad():
            hit = build()
        if len(cache) >= max_entries:
            cache.pop(next(iter(cache)))
        cache[key] = hit
    return hit


def reduce_to(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum a per-sample weight gradient over the batch when the weight was shared (leading dim 1)."""
    if like.shape[0] == 1 and t.shape[0] != 1:
        t = t.sum(0, keepdim=True)
    return t


def triton_module(package: str) -> ModuleType:
    """``<package>.triton``, imported on first use (CPU users never import Triton)."""
    return importlib.import_module(".triton", package)


def make_function(name: str, fwd, bwd, n_weights: int):
    """An ``autograd.Function`` over an inner step ``fwd(q, k, v, *weights, *consts) -> (out, *aux)`` and its
    ``bwd(do, q, k, v, *weights, *aux, *consts) -> grads``: stores the inputs and ``aux`` only, autocast off inside
    (shared by the ``torch`` and the Triton paths of the op folders)."""

    def forward(ctx, q, k, v, *rest):
        weights, consts = rest[:n_weights], rest[n_weights:]
        with no_autocast(q.device):
            out, *aux = fwd(q, k, v, *weights, *consts)
        ctx.save_for_backward(q, k, v, *weights, *aux)
        ctx.consts = consts
        return out

    def backward(ctx, do):
        with no_autocast(do.device):
            grads = bwd(do.contiguous(), *ctx.saved_tensors, *ctx.consts)
        return (*grads,) + (None,) * len(ctx.consts)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


_LAUNCH_ON_META = [False]  # set by launch_on_meta()


def launches_kernel(triton: bool, t: torch.Tensor) -> bool:
    """Inside a ``ttt_zoo::`` custom op: run its Triton kernel.  ``triton`` is the op's last argument, the choice
    its caller made once (``backend.resolve_backend``, under the op's own name); an empty batch needs no launch and
    meta tensors run only the fake (except under :func:`launch_on_meta`)."""
    return triton and t.numel() != 0 and (t.device.type != "meta" or _LAUNCH_ON_META[0])


@contextlib.contextmanager
def launch_on_meta():
    """Let the custom ops call their launchers on meta tensors, for tools that record launches without running them
    (``ttt_zoo.bench.compiled_variants``: Triton's compile keys on every standard shape, no GPU)."""
    previous, _LAUNCH_ON_META[0] = _LAUNCH_ON_META[0], True
    try:
        yield
    finally:
        _LAUNCH_ON_META[0] = previous


def count_flops_as(custom_op, impl=None) -> None:
    """Register the FLOP formula of ``custom_op`` for ``torch.utils.flop_counter.FlopCounterMode``: the FLOPs of
    its PyTorch path run on meta copies of its arguments (no compute): ``impl`` called with the arguments before
    ``triton`` (the backend choice), or without ``impl`` the op's own body with ``triton=False`` (every argument,
    those after ``triton`` included).  Without it the counter sees one opaque node and counts nothing for the inner
    step (a meta-device model runs only the fakes)."""
    from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

    names = [a.name for a in custom_op._opoverload._schema.arguments]
    at = names.index("triton")

    def meta(a):
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        return [meta(t) for t in a] if isinstance(a, (list, tuple)) else a

    def flops(*args, out_val=None, **kwargs):
        args = [meta(a) for a in args]
        kwargs = {k: meta(v) for k, v in kwargs.items() if k != "triton"}
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            if impl is not None:
                impl(*args[:at])
            else:
                custom_op._init_fn(*args[:at], False, *args[at + 1:], **kwargs)
        return counter.get_total_flops()

    register_flop_formula(custom_op._opoverload._overloadpacket, get_raw=True)(flops)
