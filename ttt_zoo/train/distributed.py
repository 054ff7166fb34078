"""Process-group plumbing for ``ttt-zoo train``: torchrun's environment in, a :class:`DistInfo` out.

One process: no process group.  Under torchrun (``WORLD_SIZE`` > 1): ``init_process_group`` from the environment,
nccl on GPUs and gloo on CPU.  Metrics are reduced as sums (of values and counts) so every rank gets exact totals.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as torch_dist

__all__ = ["DistInfo", "init_distributed", "destroy_distributed", "all_reduce_sum", "all_gather_object",
           "barrier", "broadcast_object", "lay_out_as_gradients"]


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    is_primary: bool = True

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: Optional[str] = None) -> DistInfo:
    """Read torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``; start the process group when there are several.

    ``device``: 'cuda', 'cpu' (or 'cuda:N' for one process); default: cuda when available.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch.cuda.is_available() is False; "
                               "pass --device cpu.")
        if world_size > 1:
            dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev if dev.index is not None else 0)
    if world_size > 1 and not torch_dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        torch_dist.init_process_group(backend=backend, init_method="env://", **kw)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev, is_primary=rank == 0)


def destroy_distributed() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def _active() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1


def all_reduce_sum(values: Sequence[float], device: torch.device) -> List[float]:
    """Sum a few numbers over all ranks (float64, so counts stay exact)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if _active():
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return t.tolist()


def all_gather_object(obj: Any) -> List[Any]:
    """Every rank's ``obj`` as a list indexed by rank (a one-element list without a process group)."""
    if not _active():
        return [obj]
    out = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not _active():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if _active():
        torch_dist.barrier()


def lay_out_as_gradients(model: torch.nn.Module) -> int:
    """Lay out channels-last each conv weight for which that is the same memory order as NCHW (a depthwise
    ``(C, 1, k, k)`` or a pointwise ``(O, I, 1, 1)`` weight: only the strides of its size-1 dims differ), as its
    gradient comes, so DDP's bucket views (made with the parameters' strides) match the gradients.  Returns how
    many were changed.

    The blocks feed their convs the channels-last view of the tokens (``ttt_zoo.layers.tokens_as_map``), so a conv
    runs channels-last and returns its weight's gradient channels-last, e.g. strides ``(9, 1, 3, 1)`` for a
    ``(16, 1, 3, 3)`` weight made with ``(9, 9, 3, 1)``: the same memory order, but DDP compares strides and warned
    "grad strides do not match bucket view strides" at every start (and copied each such gradient into its bucket).
    A channels-last weight makes the conv run channels-last whatever its input, so the two always agree."""
    changed = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Conv2d) or w is None:
            continue
        laid_out = torch.empty_like(w, memory_format=torch.channels_last)
        if laid_out.is_contiguous() and laid_out.stride() != w.stride():  # the same memory order, other strides
            w.data = laid_out.copy_(w.detach())  # the Parameter (and what refers to it) stays
            changed += 1
    return changed
