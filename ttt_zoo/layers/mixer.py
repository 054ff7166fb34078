"""The one TTT token-mixer interface shared by every family.

A mixer maps tokens ``x: (B, N, C)`` laid out in raster order on a feature map of ``feat_size = (H, W)``
(``N == H * W``) to ``(B, N, C)``.  The map shape is always passed explicitly, so non-square inputs work.
Its constructor takes ``(dim, num_heads=, qkv_bias=, proj_drop=, **its own options)``.  Every family takes the
mixer as a model kwarg (``timm.create_model(name, mixer='my_mixer', mixer_kwargs={...})``) and builds it through
:func:`create_mixer`; see docs/adding_a_mixer.md.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from timm.layers import register_notrace_module

__all__ = ["TTTMixer", "register_mixer", "create_mixer", "list_mixers", "family_mixer_kwargs", "set_inner_steps"]

_MIXERS: Dict[str, Callable[..., "TTTMixer"]] = {}


class TTTMixer(nn.Module):
    """Base class.  Subclasses implement ``forward(x, feat_size)`` and list their TTT-only parameters."""

    #: names (relative to the mixer) of parameters that exist only because of test-time training;
    #: ``linearize`` initialises exactly these and optimizers may give them a larger learning rate
    inner_param_names: Tuple[str, ...] = ()

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def _init_heads(self, dim: int, num_heads: int) -> int:
        """Check and record the head split (``dim``, ``num_heads``, ``head_dim``); returns the head dim."""
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        return self.head_dim

    def _init_projections(self, dim: int, qkv_bias: bool, proj_drop: float, qk_convs: bool = False) -> None:
        """Softmax attention's ``qkv`` / ``proj`` (+ dropout), inheritable when linearising; ``qk_convs``: the
        T5 mixers' residual depthwise 3x3 ``q_conv2d`` / ``k_conv2d`` after them (keys and order are official)."""
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if qk_convs:
            self.q_conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
            self.k_conv2d = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)

    def ttt_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if n.split(".")[0] in self.inner_param_names]


def register_mixer(name: str):
    """Register a mixer class under ``name``.  Mixers are torch.fx leaves (their inner loops branch on shapes)."""
    def wrap(cls):
        if name in _MIXERS:
            raise ValueError(f"TTT mixer {name!r} is already registered")
        _MIXERS[name] = cls
        return register_notrace_module(cls)
    return wrap


def create_mixer(name: str, dim: int, **kwargs) -> TTTMixer:
    if name not in _MIXERS:
        raise ValueError(f"Unknown TTT mixer {name!r}; available: {sorted(_MIXERS)}")
    return _MIXERS[name](dim, **kwargs)


def list_mixers() -> List[str]:
    return sorted(_MIXERS)


def family_mixer_kwargs(mixer: str, family_mixer: str, family_defaults: Dict[str, Any],
                        mixer_kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The mixer options a family passes: its defaults for its own mixer (e.g. H-ViT3's ``rope=True`` for
    ``'vit3'``) only when that mixer is chosen, then the caller's ``mixer_kwargs`` for whichever mixer it is."""
    kwargs = dict(family_defaults) if mixer == family_mixer else {}
    kwargs.update(mixer_kwargs or {})
    return kwargs


def set_inner_steps(model: nn.Module, steps: int) -> None:
    """k inner steps at inference (Figure 1 of "TTT with KV Binding Is Secretly Linear Attention") on every mixer
    of ``model``; each mixer's ``set_inner_steps`` checks the value.  Raises if a mixer has no such option."""
    mixers = [m for m in model.modules() if isinstance(m, TTTMixer)]
    if not mixers:
        raise ValueError(f"{type(model).__name__} has no TTT mixer to set inner steps on")
    for m in mixers:
        if not hasattr(m, "set_inner_steps"):
            raise ValueError(f"the {type(m).__name__} mixer has no inner_steps option")
        m.set_inner_steps(steps)
