"""Vision-TTT mixer: TTT-Linear over a bidirectional raster scan with a 3x3 depthwise-conv front end.

Reconstruction of the Vittt block (Kong et al., "Vision-TTT"; ``shared/spec/visionttt.md`` §2.3):
``x_c = DWConv3x3(x)``; ``[u_qk, u_g, u_v, lr] = Linear(x_c)``; per head of d channels a TTT-Linear scan in
the mini-batch dual form over the raster order and over the flipped order (both from the same W0 by default),
``z = post_norm(Z_forth + flip(Z_back))`` (Eq. 12); ``out = o_proj(GELU_tanh(u_g) * z)``.
Items the paper does not state are constructor options with the spec's proposed defaults.
"""

from typing import Dict, Final, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module
from timm.layers import register_notrace_function

from ttt_zoo.kernels import linear_attention_bidir, token_tau, ttt_linear_bidir
from ttt_zoo.kernels.backend import resolve_backend, tracing
from ttt_zoo.kernels.ttt_linear.ops import ttt_linear_bidir_op
from ttt_zoo.kernels.utils import cached_constant, launches_kernel
from ttt_zoo.kernels.linear_attention import la_bidir_reference
from . import la_forms as laf
from .joint_linear import joint_linear
from .block import map_to_tokens, tokens_as_map, tokens_to_map
from .mixer import TTTMixer, hooked_value_output, register_mixer
from .recompute import can_recompute, linear_of_recomputed
from .variants import VariantOptions, check_variant_options

__all__ = ["TTTLinearMixer"]

_W0_MODES = ("shared", "separate", "frozen")


@register_notrace_function
def _check_tokens(x: torch.Tensor, feat_size: Tuple[int, int], name: str) -> None:
    if x.shape[1] != feat_size[0] * feat_size[1]:
        raise ValueError(f"{name}: {x.shape[1]} tokens do not fill a feature map of {tuple(feat_size)}; "
                         f"pass feat_size=(H, W) with H * W == N.")


_CONSTANTS: Dict[Tuple, torch.Tensor] = {}  # kernels.utils.cached_constant: built once per key, no launches


_QK_MODES = ("shared", "conv_q")
_INNER_LOSSES = ("mse", "dot")


@register_mixer("ttt_linear")
class TTTLinearMixer(VariantOptions, TTTMixer):
    """Bidirectional TTT-Linear token mixer (Vittt block).

    Args:
        dim: channels D.
        num_heads: heads (head dim D / heads); alternatively give ``head_dim`` (default 64).
        head_dim: inner-state size d per head (64 in the paper; 32 also supported).
        qkv_bias: bias of the fused q/k, gate, v and lr projections.
        mini_batch: tokens per inner gradient step (b = 16).
        base_lr: inner learning-rate scale; per token ``lr = base_lr * sigmoid(logit) / d``.
        w0_mode: ``'shared'`` one learnable (W0, b0) for both directions (paper W0^1), ``'separate'`` one per
            direction (W0^2), ``'frozen'`` zero, non-learnable (W0^0).
        qk_mode: ``'shared'`` q = k = u_qk with the conv in front of all projections, ``'conv_q'`` the conv acts on
            u_qk for q only (k = u_qk, everything else from x).
        inner_rope: RoPE of the in-mini-batch position on q and k (ttt-lm).
        inner_ln_residual: inner model ``x + LN(xW + b)`` with target ``v - k`` (ttt-lm; the default for
            ``inner_loss='mse'``); False gives the paper's literal ``f(x) = xW + b`` with target v.
        proj_per_direction: apply the q/k, v and lr projections once per scan direction, as the paper's FLOP count
            assumes, and the scan forms q S apart from k S (q = k); outputs are identical, it only costs extra MACs.
            Default False: project once, flip, and share q = k.
        backend: backend of the TTT ops (``auto`` | ``torch`` | ``torch_naive`` | ``triton``, see
            ``ttt_zoo.kernels.backend``; ``None`` = the process default, ``TTT_ZOO_BACKEND`` or auto).
        inner_loss: ``'mse'`` (TTT-Linear, above); ``'dot'``: the plain linear-attention Vision-TTT: inner model
            ``f(x) = x W + b`` (no inner LayerNorm, no residual; ``inner_ln_residual`` must stay unset) and loss
            ``-<f(k), v>``, whose gradient does not depend on the state, so the mini-batch scan is linear
            attention with an exact chunk-parallel form (op ``linear_attention``; models ``visionttt_*_la``).

    Variants of "TTT with KV Binding Is Secretly Linear Attention" (Liu et al., Tables 1-2) where they apply:
        gradient_ascent: Table 1: the inner step adds the gradient (the per-token lr negated, exact in the dual
            form).  With ``inner_loss='dot'`` this is exactly descent with v negated.
        inner_steps: Figure 1's k inner steps per mini-batch: only with ``inner_loss='dot'``, where the gradient
            does not depend on the state and k steps are exactly one step with k times the lr (settable later).
        inner_update='last' (V1), inner_model='linear' (V3), normalize_grad=True (V6), share_qk=True raise: the
            inner model is already a single linear layer (W, b) under a LayerNorm, nothing normalises its
            gradient, and q = k already (``qk_mode='shared'``; ``'conv_q'`` is the separate-query form).

    In training ``GELU_tanh(u_g) * post_norm(z)`` is recomputed in the backward rather than kept
    (:mod:`ttt_zoo.layers.recompute`; ``recompute_act = False`` keeps it).
    """
    recompute_act: bool = True
    # TorchScript: constants (only the live scan is compiled) and the Python-only inner_steps property
    dot_loss: Final[bool]
    gradient_ascent: Final[bool]
    __jit_unused_properties__ = ["inner_steps"]
    inner_param_names = ("w0", "b0", "tau_offset", "ttt_norm_weight", "ttt_norm_bias", "lr_proj")

    def __init__(self, dim: int, num_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = True, mini_batch: int = 16, base_lr: float = 1.0, w0_mode: str = "shared",
                 qk_mode: str = "shared", inner_rope: bool = True, rope_theta: float = 10000.0,
                 inner_ln_residual: Optional[bool] = None, proj_per_direction: bool = False, proj_drop: float = 0.0,
                 backend: Optional[str] = None, inner_loss: str = "mse", inner_update: str = "all",
                 inner_model: Optional[str] = None, normalize_grad: bool = False, gradient_ascent: bool = False,
                 share_qk: bool = False, inner_steps: int = 1):
        super().__init__()
        name = "TTTLinearMixer"
        inner_steps = check_variant_options(name, inner_update, inner_model, (None, "linear"), inner_steps)
        if inner_loss not in _INNER_LOSSES:
            raise ValueError(f"{name}: inner_loss must be one of {_INNER_LOSSES}, got {inner_loss!r}")
        if inner_update != "all":
            raise ValueError(f"{name}: inner_update={inner_update!r} (Table 2 Variant 1) does not apply: the inner "
                             f"model is a single linear layer (W, b) under a LayerNorm, already the last layer.")
        if inner_model is not None:
            raise ValueError(f"{name}: inner_model={inner_model!r} (Table 2 Variant 3) does not apply: the inner "
                             f"model is already one linear layer (W, b) (+ LayerNorm and residual); "
                             f"inner_loss='dot' is the plain linear-attention form.")
        if normalize_grad:
            raise ValueError(f"{name}: normalize_grad=True does not apply: TTT-Linear's inner gradient is not "
                             f"normalised (Table 2 Variant 6 is already the baseline).")
        if share_qk:
            raise ValueError(f"{name}: share_qk=True does not apply: q = k already (qk_mode='shared', the Vittt "
                             f"default, one projection u_qk); qk_mode='conv_q' is the form with a separate query.")
        if inner_loss == "dot":
            if inner_ln_residual:
                raise ValueError(f"{name}: inner_loss='dot' has no inner LayerNorm or residual; leave "
                                 f"inner_ln_residual unset (or False)")
            inner_ln_residual = False
        elif inner_steps != 1:
            raise ValueError(f"{name}: inner_steps={inner_steps} needs inner_loss='dot': the mini-batch dual form "
                             f"defines one step per mini-batch, and with the LayerNorm loss the gradient depends "
                             f"on the state.")
        if inner_ln_residual is None:
            inner_ln_residual = True
        self.inner_loss = inner_loss
        self.dot_loss = inner_loss == "dot"
        self.gradient_ascent = gradient_ascent
        self._inner_steps = inner_steps
        if head_dim is None:
            head_dim = dim // num_heads if num_heads else 64
        if num_heads is not None and num_heads * head_dim != dim:
            raise ValueError(f"num_heads={num_heads} and head_dim={head_dim} do not multiply to dim={dim}")
        if dim % head_dim:
            raise ValueError(f"dim {dim} must be divisible by head_dim {head_dim}")
        if w0_mode not in _W0_MODES:
            raise ValueError(f"w0_mode must be one of {_W0_MODES}, got {w0_mode!r}")
        if qk_mode not in _QK_MODES:
            raise ValueError(f"qk_mode must be one of {_QK_MODES}, got {qk_mode!r}")
        if mini_batch < 1:
            raise ValueError(f"mini_batch must be >= 1, got {mini_batch}")
        self.dim = dim
        self.head_dim = d = head_dim
        self.num_heads = nh = dim // head_dim
        self.mini_batch = mini_batch
        self.base_lr = base_lr
        self.w0_mode = w0_mode
        self.qk_mode = qk_mode
        self.inner_rope = inner_rope
        self.rope_theta = rope_theta
        self.inner_ln_residual = inner_ln_residual
        self.proj_per_direction = proj_per_direction
        self.backend = backend

        self.conv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=False)
        self.proj = nn.Linear(dim, 3 * dim, bias=qkv_bias)  # [u_qk, u_g, u_v]; one GEMM with lr_proj in training (_project)
        self.lr_proj = nn.Linear(dim, nh)
        self.tau_offset = nn.Parameter(torch.zeros(mini_batch))
        if inner_loss == "mse":
            self.ttt_norm_weight = nn.Parameter(torch.ones(nh, d))
            self.ttt_norm_bias = nn.Parameter(torch.zeros(nh, d))
        n_w0 = 2 if w0_mode == "separate" else 1
        if w0_mode == "frozen":
            self.register_buffer("w0", torch.zeros(1, nh, d, d), persistent=False)
            self.register_buffer("b0", torch.zeros(1, nh, 1, d), persistent=False)
        else:
            self.w0 = nn.Parameter(torch.zeros(n_w0, nh, d, d))
            self.b0 = nn.Parameter(torch.zeros(n_w0, nh, 1, d))
        self.post_norm = nn.LayerNorm(dim, eps=1e-6)
        self.o_proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_inner_parameters()

    def reset_inner_parameters(self) -> None:
        if self.w0.device.type == "meta":
            return
        with torch.no_grad():
            if isinstance(self.w0, nn.Parameter):
                nn.init.normal_(self.w0, std=0.02)
                nn.init.zeros_(self.b0)
            nn.init.normal_(self.lr_proj.weight, std=0.02)
            nn.init.zeros_(self.lr_proj.bias)
            nn.init.zeros_(self.tau_offset)
            if self.inner_loss == "mse":
                nn.init.ones_(self.ttt_norm_weight)
                nn.init.zeros_(self.ttt_norm_bias)

    @property
    def inner_steps(self) -> int:
        return self._inner_steps

    @inner_steps.setter
    def inner_steps(self, steps: int) -> None:  # VariantOptions has checked it is an integer >= 1
        if steps != 1 and self.inner_loss != "dot":
            raise ValueError("TTTLinearMixer: inner_steps > 1 needs inner_loss='dot' (see the class docstring)")
        self._inner_steps = steps

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def _conv(self, t: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        return map_to_tokens(self.conv(tokens_as_map(t, feat_size)))

    def inner_inputs(self, x: torch.Tensor, feat_size: Tuple[int, int]
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head q, k, v (B, heads, N, d), per-token lr (B, heads, N) and the gate input u_g (B, N, D)."""
        q, k, v, logits, u_g = self._inputs_and_logits(x, feat_size)
        return q, k, v, (self.base_lr / self.head_dim) * torch.sigmoid(logits), u_g

    def _inputs_and_logits(self, x: torch.Tensor, feat_size: Tuple[int, int]
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`inner_inputs` with the lr's logits (B, heads, N) in place of the lr."""
        c = x.shape[2]
        _check_tokens(x, feat_size, "TTTLinearMixer")
        src = self._conv(x, feat_size) if self.qk_mode == "shared" else x
        u_qk, u_g, u_v, logits = self._project(src)
        if self.proj_per_direction:
            # the backward direction's q/k, v and lr projections run on the flipped sequence (same values)
            w, pb = self.proj.weight, self.proj.bias
            bqv: Optional[torch.Tensor] = None
            if pb is not None:
                bqv = torch.cat([pb[:c], pb[2 * c:]], 0)
            src_b = src.flip(1)
            u_qk, u_v = torch.split(F.linear(src_b, torch.cat([w[:c], w[2 * c:]], 0), bqv).flip(1), [c, c], dim=-1)
            logits = self.lr_proj(src_b).flip(1)
        k = self._heads(u_qk)
        q = self._heads(self._conv(u_qk, feat_size)) if self.qk_mode == "conv_q" else k
        if self.proj_per_direction and q is k:
            q = k.clone()  # a distinct q: the scan then forms q S apart from k S, as the paper's FLOP count does
        v = self._heads(u_v)
        return q, k, v, logits.transpose(1, 2), u_g

    def _project(self, src: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[u_qk, u_g, u_v] = proj(src)`` and the lr logits ``lr_proj(src)``.  In training one GEMM over both
        (``joint_linear``: 5 launches forward + backward instead of 8); in inference the two GEMMs (joining the
        weights would cost a launch and save none) and wherever a hook must see ``proj``."""
        c = self.dim
        if not torch.jit.is_scripting():
            if self._fuse_projections(src):
                both = joint_linear(src, [(self.proj.weight, self.proj.bias),
                                          (self.lr_proj.weight, self.lr_proj.bias)])
                u_qk, u_g, u_v, logits = torch.split(both, [c, c, c, self.num_heads], dim=-1)
                return u_qk, u_g, u_v, logits
        u_qk, u_g, u_v = torch.split(self.proj(src), [c, c, c], dim=-1)
        return u_qk, u_g, u_v, self.lr_proj(src)

    @torch.jit.unused
    def _fuse_projections(self, src: torch.Tensor) -> bool:
        if isinstance(src, torch.fx.Proxy) or not torch.is_grad_enabled() or tracing():
            return False  # traced graphs (compile, export, ONNX) see the two Linears; compilers fuse them
        if not (src.requires_grad or self.proj.weight.requires_grad or self.lr_proj.weight.requires_grad):
            return False
        if _module._global_forward_hooks or _module._global_forward_pre_hooks:
            return False
        return not any(m._forward_hooks or m._forward_pre_hooks for m in (self.proj, self.lr_proj))

    def _scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor,
              return_grad_norm: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Both scan directions with the per-token lr (negated for ``gradient_ascent``, times the inner steps of the
        dot loss).  The scans use lr only in the products ``tau_i lr_j``, so those factors go into tau (16 numbers)
        rather than into the (B, heads, N) lr."""
        dt = q.dtype
        rate = lr
        scale = 1.0
        if self.gradient_ascent:  # the update is -lr * grad everywhere in the dual form: flip lr's sign
            scale = -scale
        if self.dot_loss:
            if return_grad_norm:
                raise ValueError("inner_grad_norm is defined for inner_loss='mse' only")
            scale = scale * float(self._inner_steps)  # state-independent gradient: k steps = k times the lr
        if scale < 0:
            rate = -rate
        tau = self._scaled_tau(abs(scale)).to(dt)
        rope = self.rope_theta if self.inner_rope else None
        if self.dot_loss:
            if torch.jit.is_scripting():
                return la_bidir_reference(q, k, v, rate, tau, self.w0.to(dt), self.b0.to(dt), self.mini_batch,
                                          rope), None
            return linear_attention_bidir(q, k, v, rate, tau, self.w0.to(dt), self.b0.to(dt), self.mini_batch, rope,
                                          self.backend), None
        return ttt_linear_bidir(
            q, k, v, rate, tau, self.w0.to(dt), self.b0.to(dt), self.ttt_norm_weight.to(dt),
            self.ttt_norm_bias.to(dt), self.mini_batch, self.inner_ln_residual, rope, 1e-6, return_grad_norm,
            self.backend)

    @torch.jit.unused
    def _rate_in_kernels(self, q: torch.Tensor) -> bool:
        """Eager TTT-Linear (either inner loss) on the Triton kernels: they form the rate ``base_lr / d *
        sigmoid(logit)`` and tau themselves (no launches of their own, forward or backward).  Chosen under the op
        the kernels run as, so ``auto`` takes them only where that op is verified: the dot loss
        ``linear_attention_bidir``, the MSE loss ``ttt_linear_bidir``."""
        if self.base_lr == 0 or isinstance(q, torch.fx.Proxy) or tracing():
            return False
        op = "linear_attention_bidir" if self.dot_loss else "ttt_linear_bidir"
        return resolve_backend(self.backend, q.device, q.dtype, self.head_dim, op) == "triton"

    @torch.jit.unused
    def _kernel_scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """:meth:`_scan` with the lr's logits and tau's offsets: the Triton op forms the rate (scale ``base_lr / d``,
        its sign the ascent's, times the dot loss's inner steps) and ``token_tau`` itself.  The inner parameters go
        in as they are (float32 under autocast): the kernels read them in fp32 and write their gradients in the
        parameters' dtype, so a bf16 step launches no cast for them (10 fewer) and keeps them unrounded."""
        scale = (-1.0 if self.gradient_ascent else 1.0) * self.base_lr / self.head_dim
        rope = self.rope_theta if self.inner_rope else None
        ln_w = ln_b = None
        if self.dot_loss:
            scale = scale * float(self._inner_steps)
        else:
            ln_w, ln_b = self.ttt_norm_weight, self.ttt_norm_bias
        return ttt_linear_bidir_op(
            q, k, v, logits, self.tau_offset, self.w0, self.b0, ln_w, ln_b, self.mini_batch,
            self.inner_ln_residual, rope, 1e-6, triton=True, lr_scale=scale, tau_offset=True,
            dot_loss=self.dot_loss)[0]

    @torch.jit.unused
    def _gate_in_kernel(self) -> bool:
        """The gate in one Triton launch (on the Triton path, real tensors with tokens) unless a hook must see
        ``post_norm`` called."""
        pn = self.post_norm
        return not (pn._forward_hooks or pn._forward_pre_hooks or _module._global_forward_hooks
                    or _module._global_forward_pre_hooks)

    @torch.jit.unused
    def _kernel_gate(self, u_g: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor,
                     norm_b: torch.Tensor) -> torch.Tensor:
        from ttt_zoo.kernels.ttt_linear.gate import gelu_gate  # Triton: imported where it runs
        return gelu_gate(u_g, z, norm_w, norm_b, self.post_norm.eps)

    @torch.jit.unused
    def _kernel_gate_vjp(self, u_g: torch.Tensor, dy: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor,
                         norm_b: torch.Tensor):
        """The gate's output and gradients from its backward kernel (the recompute's ``mid_vjp``: no forward
        launch in the backward)."""
        from ttt_zoo.kernels.ttt_linear.gate import gelu_gate_vjp  # Triton: imported where it runs
        return gelu_gate_vjp(u_g, dy, z, norm_w, norm_b, self.post_norm.eps)

    def _scaled_tau(self, scale: float) -> torch.Tensor:
        """``scale * token_tau(tau_offset)`` for ``scale >= 0``, as ``relu(scale / i + scale * offset_i)``: the
        ``scale / i`` table is a per-process constant, so this is two launches (token_tau: five)."""
        off = self.tau_offset
        b = self.mini_batch
        if torch.jit.is_scripting():
            base = scale / torch.arange(1, b + 1, device=off.device, dtype=off.dtype)
        else:
            base = self._inv_positions(scale)
        return F.relu(torch.add(base, off, alpha=scale))

    @torch.jit.unused
    def _inv_positions(self, scale: float) -> torch.Tensor:
        off = self.tau_offset
        b = self.mini_batch
        make = lambda: scale / torch.arange(1, b + 1, device=off.device, dtype=off.dtype)  # noqa: E731
        if isinstance(off, torch.fx.Proxy) or tracing():
            return make()  # traced graphs compute it (a cached tensor would become a graph constant)
        return cached_constant(_CONSTANTS, ("inv_positions", b, scale, off.device, off.dtype), make)

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v, logits, u_g = self._inputs_and_logits(x, feat_size)
        z = q
        rate_in_kernels = False
        if not torch.jit.is_scripting():
            rate_in_kernels = self._rate_in_kernels(q)
            if rate_in_kernels:
                z = self._kernel_scan(q, k, v, logits)
        if not rate_in_kernels:
            z, _ = self._scan(q, k, v, (self.base_lr / self.head_dim) * torch.sigmoid(logits))
        z = z.transpose(1, 2).reshape(b, n, c)
        if not torch.jit.is_scripting():
            gate_in_kernel = rate_in_kernels and self._gate_in_kernel() and launches_kernel(True, z)
            if can_recompute(self, z):  # training: keep u_g and z only (ttt_zoo.layers.recompute)
                return linear_of_recomputed(self._gate, u_g, self.o_proj, z, self.post_norm.weight,
                                            self.post_norm.bias, mid_vjp=self._kernel_gate_vjp if gate_in_kernel
                                            else None)
            if gate_in_kernel:
                return self.proj_drop(self.o_proj(self._kernel_gate(u_g, z, self.post_norm.weight,
                                                                    self.post_norm.bias)))
        return self.proj_drop(self.o_proj(F.gelu(u_g, approximate="tanh") * self.post_norm(z)))

    def _gate(self, u_g: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, norm_b: torch.Tensor) -> torch.Tensor:
        """``GELU_tanh(u_g) * post_norm(z)``, the input of ``o_proj``."""
        if not torch.jit.is_scripting():
            if self._gate_in_kernel() and self._rate_in_kernels(z) and launches_kernel(True, z):
                return self._kernel_gate(u_g, z, norm_w, norm_b)
        z = F.layer_norm(z, z.shape[-1:], norm_w, norm_b, self.post_norm.eps)
        return F.gelu(u_g, approximate="tanh") * z

    @torch.jit.ignore
    def inner_grad_norm(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        """Per-token ``||grad_W l_t||_F`` (Eq. 6) over all heads (block-diagonal W), (2 directions, B, N)."""
        q, k, v, lr, _ = self.inner_inputs(x, feat_size)
        _, gn = self._scan(q, k, v, lr, return_grad_norm=True)
        return gn.pow(2).sum(2).sqrt()

    # ---- the exact linear-attention form (every option: both inner losses, W0 modes, q/k modes, RoPE, ascent, steps)
    def linear_attention_unsupported(self) -> Optional[str]:
        return None

    @torch.jit.unused
    def linear_attention_inputs(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Dict[str, torch.Tensor]:
        """q, k, v (B, N, C) in token order, the gate input u_g and the per-token lr (B, N, heads), unsigned."""
        c = x.shape[2]

        def conv(t):
            return map_to_tokens(F.conv2d(tokens_to_map(t, feat_size), self.conv.weight, None, padding=1, groups=c))
        src = conv(x) if self.qk_mode == "shared" else x
        u_qk, u_g, u_v = torch.split(F.linear(src, self.proj.weight, self.proj.bias), [c, c, c], dim=-1)
        q = conv(u_qk) if self.qk_mode == "conv_q" else u_qk
        lr = (self.base_lr / self.head_dim) * torch.sigmoid(F.linear(src, self.lr_proj.weight, self.lr_proj.bias))
        return dict(q=q, k=u_qk, v=u_v, u_g=u_g, lr=lr)

    @torch.jit.unused
    def linear_attention_form_from_inputs(self, t: Dict[str, torch.Tensor], feat_size: Tuple[int, int]
                                          ) -> laf.VisionTTTForm:
        """Each scan direction as :class:`~ttt_zoo.layers.la_forms.ScanForm`; ``lr`` signed (ascent) and, for
        the dot loss, times the inner steps (its gradient -v does not depend on the state)."""
        h, d = self.num_heads, self.head_dim
        q, k, v = laf.heads(t["q"], h), laf.heads(t["k"], h), laf.heads(t["v"], h)
        lr = t["lr"].transpose(1, 2) * ((-1.0 if self.gradient_ascent else 1.0) * self._inner_steps)
        dt = q.dtype
        tau = token_tau(self.tau_offset).to(dt)
        lnw = lnb = None
        if self.inner_ln_residual or not self.dot_loss:
            lnw, lnb = self.ttt_norm_weight.to(dt).reshape(1, h, 1, d), self.ttt_norm_bias.to(dt).reshape(1, h, 1, d)
        s0 = torch.cat([self.w0, self.b0], 2).to(dt)  # (1 | 2, heads, d + 1, d)
        flip = lambda z: z.flip(2)  # noqa: E731
        fwd = self._scan_form(q, k, v, lr, s0[:1], tau, lnw, lnb)
        bwd = self._scan_form(flip(q), flip(k), flip(v), flip(lr), s0[-1:], tau, lnw, lnb)
        pn = self.post_norm
        return laf.VisionTTTForm((fwd, bwd), self.inner_ln_residual, lnw, lnb, 1e-6, t["u_g"],
                                 (pn.weight, pn.bias, pn.eps), (self.o_proj.weight, self.o_proj.bias))

    @torch.jit.unused
    def _scan_form(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, s0: torch.Tensor,
                   tau: torch.Tensor, lnw: Optional[torch.Tensor], lnb: Optional[torch.Tensor]) -> laf.ScanForm:
        """One direction's sum form: the state per mini-batch from the earlier v' = -lr g (g = dl/df at the state
        entering the mini-batch: f - v, the LayerNorm residual's gradient, or -v for the dot loss)."""
        bsz, h, n, d = q.shape
        if self.inner_rope:
            q, k = laf.rope_half(q, self.mini_batch, self.rope_theta), laf.rope_half(k, self.mini_batch, self.rope_theta)
        one = torch.ones_like(q[..., :1])
        qa, ka = torch.cat([q, one], -1), torch.cat([k, one], -1)
        state = s0.expand(bsz, h, d + 1, d)
        vps, states = [], []
        for st in range(0, n, self.mini_batch):
            sl = slice(st, min(st + self.mini_batch, n))
            if self.dot_loss:  # l = -<f(k), v>
                g = -v[:, :, sl]
            elif self.inner_ln_residual:  # f(x) = x + LN(x W + b), target v - k
                g = laf.ln_grad(ka[:, :, sl] @ state, v[:, :, sl] - k[:, :, sl], lnw, lnb, 1e-6)
            else:  # f(x) = x W + b, target v
                g = ka[:, :, sl] @ state - v[:, :, sl]
            vp = -lr[:, :, sl, None] * g
            states.append(state)
            vps.append(vp)
            state = state + tau[-1] * ka[:, :, sl].transpose(-2, -1) @ vp
        return laf.ScanForm(qa, ka, torch.cat(vps, 2), s0, tau, lr, torch.stack(states, 2))

    @torch.jit.unused
    def implicit_map_io(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(u_v made a leaf by a hook on ``proj``, Z caught before ``post_norm``)."""
        if self.proj_per_direction:
            raise ValueError("via='mixer' needs proj_per_direction=False (the backward direction's v is projected "
                             "outside the proj module); use via='form'")
        return hooked_value_output(self, x, feat_size, self.proj, self.post_norm)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, mini_batch={self.mini_batch}, "
                f"w0_mode={self.w0_mode}, qk_mode={self.qk_mode}, inner_rope={self.inner_rope}, "
                f"inner_ln_residual={self.inner_ln_residual}, inner_loss={self.inner_loss}, "
                f"gradient_ascent={self.gradient_ascent}")
