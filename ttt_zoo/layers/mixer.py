"""The one TTT token-mixer interface shared by every family.

A mixer maps tokens ``x: (B, N, C)`` laid out in raster order on a feature map of ``feat_size = (H, W)``
(``N == H * W``) to ``(B, N, C)``.  The map shape is always passed explicitly, so non-square inputs work.
Its constructor takes ``(dim, num_heads=, qkv_bias=, proj_drop=, **its own options)``.  Every family takes the
mixer as a model kwarg (``timm.create_model(name, mixer='my_mixer', mixer_kwargs={...})``) and builds it through
:func:`create_mixer`; see docs/adding_a_mixer.md.
"""

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from timm.layers import register_notrace_module

__all__ = ["TTTMixer", "register_mixer", "create_mixer", "list_mixers", "family_mixer_kwargs", "set_inner_steps",
           "check_kwargs", "hooked_value_output"]

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

    # ---- the exact linear-attention form ("TTT with KV Binding Is Secretly Linear Attention"), per mixer class
    def linear_attention_unsupported(self) -> Optional[str]:
        """Why this mixer (with its options) has no exact linear-attention form; None when it has one."""
        return "no exact form is implemented for this mixer"

    def linear_attention_inputs(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Dict[str, torch.Tensor]:
        """Stage 1, the projections: q, k, v (B, N, channels) in token order (+ what the form needs); ``v`` is the
        value every attention map is taken against."""
        raise NotImplementedError(self._no_form_message())

    def linear_attention_form_from_inputs(self, inputs: Dict[str, torch.Tensor], feat_size: Tuple[int, int]):
        """Stage 2: the form from :meth:`linear_attention_inputs` (differentiable in them)."""
        raise NotImplementedError(self._no_form_message())

    def linear_attention_form(self, x: torch.Tensor, feat_size: Tuple[int, int]):
        """The exact linear-attention form on tokens ``x`` (B, N, C) of a ``feat_size`` map (``form.output()`` equals
        the mixer's output, eval mode).  Raises NotImplementedError (one line) where the mixer has none."""
        self._no_form_message(check=True)
        fs = (int(feat_size[0]), int(feat_size[1]))
        if x.dim() != 3 or x.shape[1] != fs[0] * fs[1]:
            raise ValueError(f"x must be (B, N, C) tokens with N = H * W = {fs[0] * fs[1]} for feat_size={fs}, "
                             f"got shape {tuple(x.shape)}")
        return self.linear_attention_form_from_inputs(self.linear_attention_inputs(x, fs), fs)

    def _no_form_message(self, check: bool = False) -> str:
        why = self.linear_attention_unsupported()
        msg = f"{type(self).__name__} has no exact linear-attention form: {why}"
        if check and why is not None:
            raise NotImplementedError(msg)
        return msg

    def implicit_map_io(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(v, o) through the mixer's own code, for the implicit attention map dO/dV: v (B, N, Cv) a leaf (the
        last ``dim`` channels of ``qkv``'s output), o (B, N, Cv) the input of ``proj``.  Mixers laid out otherwise
        override it."""
        return hooked_value_output(self, x, feat_size, getattr(self, "qkv", None), getattr(self, "proj", None))


def hooked_value_output(mixer: nn.Module, x: torch.Tensor, feat_size: Tuple[int, int], src: Optional[nn.Module],
                        out: Optional[nn.Module]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run ``mixer`` with its value (the last ``mixer.dim`` channels of ``src``'s output) made a leaf by a forward
    hook and catch the input of ``out``: (v, o)."""
    if src is None or out is None:
        raise TypeError(f"{type(mixer).__name__}: no value projection / output module to hook; override "
                        f"implicit_map_io or use via='form'")
    seen: Dict[str, torch.Tensor] = {}
    c = mixer.dim

    def make_v(mod, args, y):
        seen["v"] = y[..., -c:].detach().requires_grad_()
        return torch.cat([y[..., :-c], seen["v"]], -1)

    def catch_o(mod, args):
        seen["o"] = args[0]
    hooks = [src.register_forward_hook(make_v), out.register_forward_pre_hook(catch_o)]
    recompute = getattr(mixer, "recompute", None)
    try:
        if recompute is not None:
            mixer.recompute = False  # torch.utils.checkpoint would re-run the hook in the backward
        with torch.enable_grad():
            mixer(x, feat_size)
    finally:
        for hk in hooks:
            hk.remove()
        if recompute is not None:
            mixer.recompute = recompute
    if "v" not in seen or "o" not in seen:
        raise RuntimeError(f"{type(mixer).__name__}: the v / o hooks did not fire; use via='form'")
    return seen["v"], seen["o"]


def check_kwargs(where: str, fn: Callable, kwargs: Dict[str, Any], extra: Tuple[str, ...] = ()) -> None:
    """Raise TypeError naming every key of ``kwargs`` that ``fn`` (a class: its ``__init__`` chain through
    ``**kwargs``) does not accept, and the accepted ones."""
    accepted, open_ended = set(extra), False
    for f in ([c.__dict__["__init__"] for c in fn.__mro__ if "__init__" in c.__dict__] if inspect.isclass(fn)
              else [fn]):
        params = inspect.signature(f).parameters.values()
        accepted |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    else:
        open_ended = True
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown and not open_ended:
        raise TypeError(f"{where}: unknown keyword argument(s) {unknown}; accepted: {sorted(accepted)}")


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
    check_kwargs(f"mixer {name!r} ({_MIXERS[name].__name__}, mixer_kwargs)", _MIXERS[name], kwargs)
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
