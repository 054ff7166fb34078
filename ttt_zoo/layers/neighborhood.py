"""2-D neighbourhood attention (NA) in pure PyTorch, with natten's border rule.

Each query attends to a ``kernel_size x kernel_size`` window of keys.  At the borders the window is not cut but
shifted inside the map (natten's rule): along an axis of length L the window of query i starts at
``clamp(i - kernel_size // 2, 0, L - kernel_size)``, so every query sees exactly ``kernel_size ** 2`` keys,
ordered row-major in the window.  With dilation D the axis is split into the D interleaved sub-grids
``i % D`` and the same rule applies inside each sub-grid.

Maps smaller than the window (``clamp_to_map=True``, dilation 1): the window is clamped to the map, per axis
``min(kernel_size, L)``.  NATTEN treats a window as large as the map as plain self attention, and its op refuses a
larger one; clamping extends that case, so an axis shorter than the window is attended in full (every query sees
the whole axis).  Off by default (a too-small map raises); DiT5 turns it on, so ``dit5_*_8`` runs at its 4x4
latent token map.  A clamped window always runs in PyTorch (natten is not asked: the clamped axis is < kernel_size).

Small maps (at most :data:`DENSE_MAX_TOKENS` tokens, eager only) run as one ``F.scaled_dot_product_attention`` over
all tokens with an additive window mask (0 inside a query's window, -inf outside; built once per map size, window,
device and dtype): one launch instead of a dozen, at up to 4x the tiled form's score work, where launches and not
FLOPs set a GPU's time.  Larger maps, dilation 1 (T5+), run by query tiles: a tile x tile block of queries attends with two
batched GEMMs to the key region that holds all its windows, the keys outside each query's window masked (9x faster
than gathering every query's 25 keys at 64x64 tokens on the CPU, and ~2.25x the map in gathered keys instead of
25x).  Any other dilation gathers every query's window.

natten (https://github.com/SHI-Labs/NATTEN) is used instead when it is importable AND, checked once per device and
dtype on a small random problem, gives the same numbers as this implementation; otherwise this one runs.
"""

import importlib.util
import warnings
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from ttt_zoo.kernels.backend import exporting

__all__ = ["neighborhood_indices", "neighborhood_attention_2d", "neighborhood_attention_2d_torch",
           "natten_available", "window_size", "window_bias", "DENSE_MAX_TOKENS"]

#: maps up to this many tokens attend densely with a window mask (one SDPA launch): 4x the 144 keys a query of the
#: tiled form (tile 8, kernel 5) scores
DENSE_MAX_TOKENS = 576


def window_size(length: int, kernel_size: int, dilation: int = 1, clamp_to_map: bool = False) -> int:
    """The window along an axis of ``length``: ``kernel_size``, or with ``clamp_to_map`` (dilation 1)
    ``min(kernel_size, length)``; validates the arguments (a too-small map without clamping is an error)."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"neighbourhood attention needs an odd kernel_size >= 1, got {kernel_size}")
    if dilation < 1:
        raise ValueError(f"dilation must be >= 1, got {dilation}")
    if length < kernel_size * dilation:
        if clamp_to_map and dilation == 1 and length >= 1:
            return length  # the whole axis (NATTEN's kernel_size == input size: self attention)
        hint = " (clamp_to_map clamps dilation-1 windows only)" if clamp_to_map else ""
        raise ValueError(
            f"feature map side {length} is smaller than the neighbourhood window (kernel_size {kernel_size} x "
            f"dilation {dilation} = {kernel_size * dilation}){hint}; use a larger input or a smaller "
            f"kernel_size/dilation.")
    return kernel_size


def neighborhood_indices(length: int, kernel_size: int, dilation: int = 1,
                         device: Optional[torch.device] = None, clamp_to_map: bool = False) -> torch.Tensor:
    """(length, window) key positions of every query position along one axis (natten's border rule); the window is
    ``kernel_size``, or ``min(kernel_size, length)`` with ``clamp_to_map`` (see :func:`window_size`)."""
    kernel_size = window_size(length, kernel_size, dilation, clamp_to_map)
    i = torch.arange(length, device=device)
    residue, j = i % dilation, i // dilation
    group_len = (length - residue + dilation - 1) // dilation  # size of the sub-grid of residue i % dilation
    start = torch.minimum((j - kernel_size // 2).clamp(min=0), group_len - kernel_size)
    return residue[:, None] + dilation * (start[:, None] + torch.arange(kernel_size, device=device))


def _window_start(length: int, kernel_size: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """(length,) first key position of every query's window along one axis (natten's rule, dilation 1)."""
    i = torch.arange(length, device=device)
    return (i - kernel_size // 2).clamp(min=0).clamp(max=length - kernel_size)


def _axis_tiles(length: int, kernel_size: int, tile: int, device: Optional[torch.device] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiling of one axis for the tiled NA: query positions (n, tile) (the last tile clamped to length - 1: those
    rows are computed and cropped), key-region positions (n, R) with R = min(tile + kernel_size - 1, length), and
    the window mask (n, tile, R): key r lies in query i's window."""
    n = (length + tile - 1) // tile
    region = min(tile + kernel_size - 1, length)
    queries = (torch.arange(n, device=device)[:, None] * tile + torch.arange(tile, device=device)).clamp(max=length - 1)
    start = _window_start(length, kernel_size, device)
    # every window of a tile lies in [start of its first query, + region): start grows by at most 1 per query
    region_start = start[queries[:, 0]].clamp(max=length - region)
    keys = region_start[:, None] + torch.arange(region, device=device)
    qs = start[queries][:, :, None]
    kk = keys[:, None, :]
    return queries, keys, (kk >= qs) & (kk < qs + kernel_size)


def _gather_tiles(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(B, heads, H, W, d) -> (B, heads, n_h, n_w, r_h * r_w, d): the blocks x[rows[i]][:, cols[j]] (two row/column
    index_selects, much faster on the CPU than one broadcast advanced index)."""
    b, nh, d = x.shape[0], x.shape[1], x.shape[-1]
    n_h, r_h, n_w, r_w = rows.shape[0], rows.shape[1], cols.shape[0], cols.shape[1]
    t = x.index_select(2, rows.flatten()).index_select(3, cols.flatten())
    return t.reshape(b, nh, n_h, r_h, n_w, r_w, d).transpose(3, 4).reshape(b, nh, n_h, n_w, r_h * r_w, d)


def _na2d_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_h: int, kernel_w: int, scale: float,
                tile: int) -> torch.Tensor:
    """Dilation-1 NA by query tiles: each tile x tile block of queries attends densely (two batched GEMMs) to the
    (tile + kernel_size - 1)^2 key region that holds all its windows, with the keys outside a query's window masked.
    The key regions overlap by kernel_size - 1 rows and columns, so the gathered keys are about
    ((tile + kernel_size - 1) / tile)^2 times the map (2.25x at tile 8, kernel 5), not kernel_size^2 times."""
    b, nh, h, w, d = q.shape
    qh, kh, mh = _axis_tiles(h, kernel_h, tile, q.device)  # per-axis windows (they differ only when clamped)
    qw, kw, mw = _axis_tiles(w, kernel_w, tile, q.device)
    th, tw, rh, rw = qh.shape[0], qw.shape[0], kh.shape[1], kw.shape[1]
    # (B, heads, tiles_h, tiles_w, tile*tile, d) queries and (..., R_h*R_w, d) key / value regions
    qt = _gather_tiles(q * scale, qh, qw)
    kt = _gather_tiles(k, kh, kw)
    vt = _gather_tiles(v, kh, kw)
    allowed = (mh[:, None, :, None, :, None] & mw[None, :, None, :, None, :]).reshape(th, tw, tile * tile, rh * rw)
    logits = (qt @ kt.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    out = logits.softmax(dim=-1) @ vt  # (B, heads, tiles_h, tiles_w, tile*tile, d)
    out = out.unflatten(4, (tile, tile)).permute(0, 1, 2, 4, 3, 5, 6).reshape(b, nh, th * tile, tw * tile, d)
    return out[:, :, :h, :w]


def _window_mask_1d(length: int, kernel_size: int, dilation: int, clamp_to_map: bool,
                    device: Optional[torch.device]) -> torch.Tensor:
    """(length, length) bool: key position j lies in query i's window (natten's rule, any dilation)."""
    idx = neighborhood_indices(length, kernel_size, dilation, device, clamp_to_map)
    return torch.zeros(length, length, dtype=torch.bool, device=device).scatter_(1, idx, True)


_WINDOW_BIAS: Dict[Tuple[int, int, int, int, bool, torch.device, torch.dtype], torch.Tensor] = {}


def window_bias(h: int, w: int, kernel_size: int, dilation: int, clamp_to_map: bool, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    """(H*W, H*W) additive attention mask of 2-D NA on an H x W map, raster order: 0 where the key lies in the query's
    window, -inf elsewhere.  Cached per argument tuple in eager (a constant of the map size, like a position table)."""
    key = (h, w, kernel_size, dilation, clamp_to_map, torch.device(device), dtype)
    cached = None if torch.compiler.is_compiling() else _WINDOW_BIAS.get(key)
    if cached is not None:
        return cached
    with torch.inference_mode(False), torch.no_grad():  # a plain constant, whatever mode the first call ran in
        mh = _window_mask_1d(h, kernel_size, dilation, clamp_to_map, device)
        mw = _window_mask_1d(w, kernel_size, dilation, clamp_to_map, device)
        allowed = (mh[:, None, :, None] & mw[None, :, None, :]).reshape(h * w, h * w)
        bias = torch.zeros(h * w, h * w, device=device, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    if not torch.compiler.is_compiling():
        if len(_WINDOW_BIAS) >= 64:  # a few map sizes in practice; never grow without bound
            _WINDOW_BIAS.clear()
        _WINDOW_BIAS[key] = bias
    return bias


def _na2d_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int, dilation: int, scale: float,
                clamp_to_map: bool) -> torch.Tensor:
    """Any dilation, small maps: every query scores every key, the window mask keeps its window (one SDPA)."""
    b, nh, h, w, d = q.shape
    bias = window_bias(h, w, kernel_size, dilation, clamp_to_map, q.device, q.dtype)
    out = F.scaled_dot_product_attention(q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3), attn_mask=bias,
                                         scale=scale)
    return out.unflatten(2, (h, w))


def _na2d_gather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int, dilation: int,
                 scale: float, clamp_to_map: bool = False) -> torch.Tensor:
    """Any dilation: every query's kernel_size^2 keys and values gathered (kernel_size^2 copies of k and v)."""
    h, w = q.shape[2], q.shape[3]
    ih = neighborhood_indices(h, kernel_size, dilation, q.device, clamp_to_map)
    iw = neighborhood_indices(w, kernel_size, dilation, q.device, clamp_to_map)
    rows, cols = ih[:, None, :, None], iw[None, :, None, :]  # -> (H, W, ks, ks) windows
    kwin = k[:, :, rows, cols].flatten(4, 5)  # (B, heads, H, W, ks*ks, d)
    vwin = v[:, :, rows, cols].flatten(4, 5)
    attn = torch.einsum("bnhwd,bnhwkd->bnhwk", q * scale, kwin).softmax(dim=-1)
    return torch.einsum("bnhwk,bnhwkd->bnhwd", attn, vwin)


@register_notrace_function
def neighborhood_attention_2d_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: int,
                                    dilation: int = 1, scale: Optional[float] = None,
                                    tile: Optional[int] = None, clamp_to_map: bool = False) -> torch.Tensor:
    """Pure-PyTorch 2-D NA.  q, k, v: (B, heads, H, W, d) -> (B, heads, H, W, d).  ``scale`` defaults to d^-0.5.

    ``tile=None``: maps of at most :data:`DENSE_MAX_TOKENS` tokens attend densely under the window mask (eager;
    one launch), larger ones as ``tile=8``.  Dilation 1 runs by query tiles of ``tile`` x ``tile`` queries
    (``tile=0``: the gather form), any other dilation gathers every query's window.  ``clamp_to_map``: a map side
    shorter than the window is attended in full (module docstring); otherwise it is an error."""
    if not torch.jit.is_scripting():
        if q.dim() != 5 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
            raise ValueError(f"neighbourhood attention expects q, k, v of shape (B, heads, H, W, d), got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    h, w = q.shape[2], q.shape[3]
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    # per-axis windows; validates them against the map (clear error)
    kernel_h = window_size(h, kernel_size, dilation, clamp_to_map)
    kernel_w = window_size(w, kernel_size, dilation, clamp_to_map)
    if tile is None:
        tile = 8
        if not torch.jit.is_scripting():  # TorchScript and the exporters (ONNX): the tiled form
            if h * w <= DENSE_MAX_TOKENS and not exporting():
                return _na2d_dense(q, k, v, kernel_size, dilation, scale, clamp_to_map)
    if dilation == 1 and tile > 0:
        return _na2d_tiled(q, k, v, kernel_h, kernel_w, scale, tile)
    return _na2d_gather(q, k, v, kernel_size, dilation, scale, clamp_to_map)


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
                              use_natten: Optional[bool] = None, clamp_to_map: bool = False) -> torch.Tensor:
    """2-D NA on (B, heads, H, W, d).  ``use_natten``: ``None`` uses natten when it is installed and verified on this
    device/dtype, ``True`` requires it (error if unusable), ``False`` runs the PyTorch implementation.
    ``clamp_to_map``: a map side shorter than the window is attended in full, in PyTorch (module docstring).

    natten is a third-party accelerator of this one function, not a TTT op backend (``ttt_zoo.kernels.backend``)."""
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5
    if not torch.jit.is_scripting():
        # validates the sizes with a clear error before natten sees them
        clamped = (window_size(q.shape[2], kernel_size, dilation, clamp_to_map) != kernel_size
                   or window_size(q.shape[3], kernel_size, dilation, clamp_to_map) != kernel_size)
        if (use_natten is None or use_natten) and not clamped:
            if natten_available(q.device, q.dtype, kernel_size, dilation):
                return _natten_na2d(q, k, v, kernel_size, dilation, scale)
            if use_natten:
                raise RuntimeError("use_natten=True was requested but natten is not installed or does not match "
                                   "the PyTorch neighbourhood attention on this device/dtype; use use_natten=None.")
    return neighborhood_attention_2d_torch(q, k, v, kernel_size, dilation, scale, clamp_to_map=clamp_to_map)
