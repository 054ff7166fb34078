"""2-D neighbourhood attention (NA) in pure PyTorch, with natten's border rule.

Each query attends to a ``kernel_size x kernel_size`` window of keys.  At the borders the window is not cut but
shifted inside the map (natten's rule): along an axis of length L the window of query i starts at
``clamp(i - kernel_size // 2, 0, L - kernel_size)``, so every query sees exactly ``kernel_size ** 2`` keys,
ordered row-major in the window.  With dilation D the axis is split into the D interleaved sub-grids
``i % D`` and the same rule applies inside each sub-grid.

natten (https://github.com/SHI-Labs/NATTEN) is used instead when it is importable AND, checked once per device and
dtype on a small random problem, gives the same numbers as this implementation; otherwise this one runs.
"""

import importlib.util
import warnings
from typing import Dict, Optional, Tuple

import torch
from timm.layers import register_notrace_function

__all__ = ["neighborhood_indices", "neighborhood_attention_2d", "neighborhood_attention_2d_torch",
           "natten_available"]


def neighborhood_indices(length: int, kernel_size: int, dilation: int = 1,
                         device: Optional[torch.device] = None) -> torch.Tensor:
    """(length, kernel_size) key positions of every query position along one axis (natten's border rule)."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"neighbourhood attention needs an odd kernel_size >= 1, got {kernel_size}")
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    if length < kernel_size * dilation:
        raise ValueError(
            f"feature map side {length} is smaller than the neighbourhood window (kernel_size {kernel_size} x "
            f"dilation {dilation} = {kernel_size * dilation}); use a larger input or a smaller kernel_size/dilation.")
    i = torch.arange(length, device=device)
    residue, j = i % dilation, i // dilation
    group_len = (length - residue + dilation - 1) // dilation  # size of the sub-grid of residue i % dilation
    start = torch.minimum((j - kernel_size // 2).clamp(min=0), group_len - kernel_size)
    return residue[:, None] + dilation * (start[:, None] + torch.arange(kernel_size, device=device))


@register_notrace_function
def neighborhood_attention_2d_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int,
                                    dilation: int = 1, scale: Optional[float] = None) -> torch.Tensor:
    """Pure-PyTorch 2-D NA.  q, k, v: (B, heads, H, W, d) -> (B, heads, H, W, d).  ``scale`` defaults to d^-0.5."""
    if not torch.jit.is_scripting():
        if q.dim() != 5 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
            raise ValueError(f"neighbourhood attention expects q, k, v of shape (B, heads, H, W, d), got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    h, w = q.shape[2], q.shape[3]
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    ih = neighborhood_indices(h, kernel_size, dilation, q.device)
    iw = neighborhood_indices(w, kernel_size, dilation, q.device)
    rows, cols = ih[:, None, :, None], iw[None, :, None, :]  # -> (H, W, ks, ks) windows
    kwin = k[:, :, rows, cols].flatten(4, 5)  # (B, heads, H, W, ks*ks, d)
    vwin = v[:, :, rows, cols].flatten(4, 5)
    attn = torch.einsum("bnhwd,bnhwkd->bnhwk", q * scale, kwin).softmax(dim=-1)
    return torch.einsum("bnhwk,bnhwkd->bnhwd", attn, vwin)


def _natten_na2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int, dilation: int,
                 scale: float) -> torch.Tensor:
    import natten.functional as nf
    if hasattr(nf, "na2d_qk") and hasattr(nf, "na2d_av"):  # natten <= 0.17 unfused ops, (B, heads, H, W, d)
        attn = nf.na2d_qk(q * scale, k, kernel_size, dilation).softmax(dim=-1)
        return nf.na2d_av(attn, v, kernel_size, dilation)
    # newer natten: fused op on (B, H, W, heads, d)
    out = nf.na2d(q.permute(0, 2, 3, 1, 4), k.permute(0, 2, 3, 1, 4), v.permute(0, 2, 3, 1, 4),
                  kernel_size=kernel_size, dilation=dilation, scale=scale)
    return out.permute(0, 3, 1, 2, 4)


_NATTEN_OK: Dict[Tuple[str, torch.dtype, int, int], bool] = {}
# looked up once at import: a failing `import natten` inside a compiled forward is a graph break per call
HAS_NATTEN = importlib.util.find_spec("natten") is not None


def natten_available(device: torch.device, dtype: torch.dtype, kernel_size: int = 5, dilation: int = 1) -> bool:
    """True when natten imports and matches the PyTorch implementation on this device/dtype (checked once)."""
    if not HAS_NATTEN:
        return False
    key = (device.type, dtype, kernel_size, dilation)
    if key not in _NATTEN_OK:
        ok = False
        try:
            import natten  # noqa: F401
            g = torch.Generator().manual_seed(0)
            side = kernel_size * dilation + 3
            q, k, v = (torch.randn(2, 2, side, side + 1, 16, generator=g).to(device, dtype) for _ in range(3))
            with torch.no_grad():
                ref = neighborhood_attention_2d_torch(q, k, v, kernel_size, dilation, 0.25)
                out = _natten_na2d(q, k, v, kernel_size, dilation, 0.25)
            tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
            ok = out.shape == ref.shape and bool(torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol))
            if not ok:
                warnings.warn("natten is installed but its neighbourhood attention differs from the reference "
                              f"(max |diff| {(out.float() - ref.float()).abs().max().item():.3g}); using PyTorch.")
        except ImportError:
            ok = False
        except Exception as e:  # noqa: BLE001 - any natten failure means: do not use it
            warnings.warn(f"natten is installed but failed ({type(e).__name__}: {e}); using PyTorch.")
            ok = False
        _NATTEN_OK[key] = ok
    return _NATTEN_OK[key]


@register_notrace_function
def neighborhood_attention_2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int,
                              dilation: int = 1, scale: Optional[float] = None,
                              use_natten: Optional[bool] = None) -> torch.Tensor:
    """2-D NA on (B, heads, H, W, d).  ``use_natten``: ``None`` uses natten when it is installed and verified on this
    device/dtype, ``True`` requires it (error if unusable), ``False`` runs the PyTorch implementation.

    natten is a third-party accelerator of this one function, not a TTT op backend (``ttt_zoo.kernels.backend``)."""
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    if not torch.jit.is_scripting():
        if use_natten is None or use_natten:
            # validates the sizes with a clear error before natten sees them
            neighborhood_indices(min(q.shape[2], q.shape[3]), kernel_size, dilation)
            if natten_available(q.device, q.dtype, kernel_size, dilation):
                return _natten_na2d(q, k, v, kernel_size, dilation, scale)
            if use_natten:
                raise RuntimeError("use_natten=True was requested but natten is not installed or does not match "
                                   "the PyTorch neighbourhood attention on this device/dtype; use use_natten=None.")
    return neighborhood_attention_2d_torch(q, k, v, kernel_size, dilation, scale)
