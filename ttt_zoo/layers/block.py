"""The parameterised TTT block shared by the families: CPE -> mixer -> MLP, pre-norm residuals."""

from functools import partial
from typing import Callable, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn
from timm.layers import DropPath
from torch.nn.modules import module as _module

from ttt_zoo.kernels.dwconv import residual_dwconv_vjp, triton_path as dwconv_triton_path
from ttt_zoo.kernels.mlp_gelu import triton_path as gelu_triton_path

from .mixer import create_mixer
from .recompute import can_recompute, linear_of_recomputed

__all__ = ["ResidualCPE", "TokenMlp", "TTTBlock", "tokens_to_map", "map_to_tokens", "tokens_as_map"]


def _hooked(module: nn.Module) -> bool:
    """Hooks would miss a call that bypasses ``module`` (the fused conv reads its parameters directly)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks)


def tokens_to_map(x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
    """(B, N, C) -> (B, C, H, W).  For contiguous tokens the reshape copies and ``.contiguous()`` is free; it makes
    the result a buffer rather than a view for inductor, whose view-output stride order cannot compare symbolic
    strides (``torch.compile(dynamic=True)``: `cannot determine truth value of Relational: 64*s**2 < 64*s`).  Tokens
    that are a view of a map would give that map back as a view: make them contiguous first (H-ViT3's stages)."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], feat_size[0], feat_size[1]).contiguous()


def map_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C).  ``reshape``, not ``flatten(2)`` (the same op in eager): TorchScript's ONNX exporter
    writes ``flatten`` with a start dim > 1 with the traced sizes, fixing the token count of the graph."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3]).transpose(1, 2)  # no -1: B may be 0


def tokens_as_map(x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
    """(B, N, C) -> (B, C, H, W) for a conv to read: in eager the channels-last view of the tokens (no copy; the
    conv's channels-last output is then already in token order for :func:`map_to_tokens`: 2.5x faster than the
    NCHW round trip for a 192-channel depthwise 3x3 at 64x64 on the CPU); under TorchScript and torch.compile the
    contiguous :func:`tokens_to_map` (and under torch.jit.trace: TorchScript's ONNX exporter writes ``unflatten``
    with the traced sizes)."""
    if not torch.jit.is_scripting():
        if not torch.compiler.is_compiling() and not torch.jit.is_tracing():
            return x.unflatten(1, (feat_size[0], feat_size[1])).permute(0, 3, 1, 2)
    return tokens_to_map(x, feat_size)


class TokenMlp(nn.Module):
    """fc1 -> act -> [u + dwconv3x3(u) -> act] -> fc2.  ``dwconv=False`` is timm's ``Mlp`` (same keys).

    In training the activations between fc1 and fc2 are recomputed in the backward, not kept
    (:mod:`ttt_zoo.layers.recompute`; ``recompute_act = False`` keeps them).  Where ``backend`` resolves to Triton
    (eager), ``act(u + dwconv3x3(u))`` with an exact GELU is one ``residual_dwconv3x3`` kernel.
    """

    recompute_act: bool = True

    def __init__(self, dim: int, hidden_dim: int, act_layer: Type[nn.Module] = nn.GELU,
                 dwconv: bool = False, drop: float = 0.0, backend: Optional[str] = None):
        super().__init__()
        self.backend = backend
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.dwc = nn.Conv2d(hidden_dim, hidden_dim, 3, padding=1, groups=hidden_dim) if dwconv else None
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x)`` of a fresh tensor; GELU in place in eager inference (one 4x-wide buffer fewer per block: on
        the CPU every new large buffer is page-faulted in, 10% of this MLP's time at 64x64 tokens)."""
        if not torch.jit.is_scripting():
            if (type(self.act) is nn.GELU and not isinstance(x, torch.fx.Proxy) and not x.requires_grad
                    and not torch.compiler.is_compiling()
                    and not self.fc1._forward_hooks):  # a hook may keep fc1's output: leave it intact
                return torch.ops.aten.gelu_(x, approximate=self.act.approximate)
        return self.act(x)

    def _mid(self, feat_size: Tuple[int, int], h: torch.Tensor, *dwc_params: torch.Tensor) -> torch.Tensor:
        """act [-> u + dwconv(u) -> act], the part between fc1 and fc2 (never in place: ``h`` is kept)."""
        u = self.act(h)
        if self.dwc is None:
            return u
        fused = self._fused_dwc(u)
        if fused is not None:
            return fused(u, *dwc_params, feat_size, "gelu")
        conv = F.conv2d(tokens_as_map(u, feat_size), *dwc_params, padding=1, groups=self.dwc.groups)
        return self.act(u + map_to_tokens(conv))

    def _mid_vjp(self, feat_size: Tuple[int, int], h: torch.Tensor, dg: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor):
        """:meth:`_mid`'s output and gradients on the Triton path (an exact GELU): the conv kernel's backward writes
        its output too and takes the first GELU's gradient as it stores dh (no conv forward, no gelu_backward)."""
        g, dh, dw, db = residual_dwconv_vjp(dg, self.act(h), weight, bias, feat_size, "gelu", pre_x=h)
        return g, dh, [dw, db]

    def _plain_mid_vjp(self, h: torch.Tensor):
        """Without the conv, a GELU's recompute and gradient from one Triton launch (``kernels.mlp_gelu``), else None
        (autograd's ``gelu`` and ``gelu_backward``)."""
        if type(self.act) is nn.GELU and not _hooked(self.act):
            return gelu_triton_path(h, self.backend, self.act.approximate)
        return None

    def _fused_dwc(self, u: torch.Tensor):
        """The Triton ``residual_dwconv3x3`` for ``act(u + dwc(u))`` (exact GELU), or None: the aten ops."""
        if type(self.act) is nn.GELU and self.act.approximate == "none" and not _hooked(self.dwc):
            return dwconv_triton_path(u, self.backend)
        return None

    def _dwc_act(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        if not torch.jit.is_scripting():
            fused = self._fused_dwc(x)
            if fused is not None:
                return fused(x, self.dwc.weight, self.dwc.bias, feat_size, "gelu")
        return self._act(x + map_to_tokens(self.dwc(tokens_as_map(x, feat_size))))

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        h = self.fc1(x)
        if not torch.jit.is_scripting():
            if can_recompute(self, h):  # training: keep fc1's output only (ttt_zoo.layers.recompute)
                params = () if self.dwc is None else (self.dwc.weight, self.dwc.bias)
                vjp = self._plain_mid_vjp(h) if self.dwc is None else \
                    None if self._fused_dwc(h) is None else partial(self._mid_vjp, feat_size)
                return linear_of_recomputed(partial(self._mid, feat_size), h, self.fc2, *params, mid_vjp=vjp)
        x = self.drop1(self._act(h))
        if self.dwc is not None:
            x = self._dwc_act(x, feat_size)
        return self.drop2(self.fc2(x))


class ResidualCPE:
    """``x + cpe(x)`` on (B, N, C) tokens for a block with a depthwise 3x3 ``cpe`` and a ``backend`` (TTT and DiT
    blocks): one Triton ``residual_dwconv3x3`` launch where ``backend`` resolves to Triton (eager, no hooks on
    ``cpe``), else the aten conv and add.  A method, not a function of the module: TorchScript calls submodules only
    as attributes."""

    def _cpe(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        if not torch.jit.is_scripting():
            fused = None if _hooked(self.cpe) else dwconv_triton_path(x, self.backend)
            if fused is not None:
                return fused(x, self.cpe.weight, self.cpe.bias, feat_size)
        return x + map_to_tokens(self.cpe(tokens_as_map(x, feat_size)))


class TTTBlock(ResidualCPE, nn.Module):
    """x += cpe(x); x += drop_path(mixer(norm1(x))); x += drop_path(mlp(norm2(x))).

    Keys: ``cpe.{weight,bias}`` (official layout, a bare Conv2d), ``norm1``, ``attn`` (the mixer), ``norm2``, ``mlp``.
    The CPE (and H-ViT3's MLP conv) run the Triton ``residual_dwconv3x3`` where the mixer's ``backend`` (from
    ``mixer_kwargs``, else the process default) resolves to Triton, in eager; else the aten conv and add.
    """

    def __init__(self, dim: int, num_heads: int, mixer: str = "vit3", mlp_ratio: float = 4.0,
                 mlp_dwconv: bool = False, cpe: bool = True, qkv_bias: bool = True,
                 proj_drop: float = 0.0, drop_path: float = 0.0,
                 norm_layer: Callable[[int], nn.Module] = nn.LayerNorm, act_layer: Type[nn.Module] = nn.GELU,
                 mlp_layer: Optional[Callable[..., nn.Module]] = None, mixer_kwargs: Optional[dict] = None):
        super().__init__()
        self.backend: Optional[str] = (mixer_kwargs or {}).get("backend")
        self.cpe = nn.Conv2d(dim, dim, 3, padding=1, groups=dim) if cpe else None
        self.norm1 = norm_layer(dim)
        self.attn = create_mixer(mixer, dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop,
                                 **(mixer_kwargs or {}))
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        hidden = int(dim * mlp_ratio)
        if mlp_layer is None:
            self.mlp = TokenMlp(dim, hidden, act_layer=act_layer, dwconv=mlp_dwconv, drop=proj_drop,
                                backend=self.backend)
        else:
            self.mlp = mlp_layer(dim, hidden)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        if self.cpe is not None:
            x = self._cpe(x, feat_size)
        x = x + self.drop_path1(self.attn(self.norm1(x), feat_size))
        x = x + self.drop_path2(self.mlp(self.norm2(x), feat_size))
        return x
