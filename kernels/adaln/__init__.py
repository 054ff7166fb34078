"""adaLN glue of the DiT blocks on (B, N, C) tokens: ``modulate_norm`` (LN(x) (1 + scale) + shift),
``gate_residual`` (x + gate y) and both fused (``gate_residual_modulate_norm``): float64-capable reference, PyTorch
path, Triton kernels (one launch forward each, at most two backward), custom ops.  One op name for the backend
choice and the GPU verification: ``adaln_modulate``."""
from functools import partial
from types import SimpleNamespace
from typing import Optional

from torch import Tensor
from torch.fx import Proxy

from ..backend import TRITON_BACKEND, resolve_backend, tracing
from .naive import (adaln_block_reference, gate_residual_modulate_norm_reference, gate_residual_reference,
                    modulate_norm_reference)
from .ops import (OP, adaln_block_op, adaln_block_torch, gate_residual, gate_residual_modulate_norm,
                  modulate_norm)

__all__ = ["OP", "modulate_norm", "gate_residual", "gate_residual_modulate_norm", "triton_path",
           "modulate_norm_reference", "gate_residual_reference", "gate_residual_modulate_norm_reference",
           "adaln_block_op", "adaln_block_torch", "adaln_block_reference"]


def triton_path(x: Tensor, backend: Optional[str]) -> Optional[SimpleNamespace]:
    """For the DiT blocks, which keep their aten LayerNorm and ``addcmul`` otherwise: the three functions on their
    Triton kernels when ``backend`` resolves to Triton for ``x`` and no graph is being captured (torch.fx,
    TorchScript, torch.compile and the exporters keep the aten ops), else None."""
    if isinstance(x, Proxy) or tracing():
        return None
    if resolve_backend(backend, x.device, x.dtype, None, OP) != TRITON_BACKEND:
        return None
    return SimpleNamespace(modulate_norm=partial(modulate_norm, triton=True),
                           gate_residual=partial(gate_residual, triton=True),
                           gate_residual_modulate_norm=partial(gate_residual_modulate_norm, triton=True))
