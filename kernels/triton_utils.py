"""Triton helpers shared by the op folders' kernels: launch choices and masked tile loads / stores.

Imported only by the ``<op>/triton.py`` modules (CPU users never import Triton).  Every load is upcast to float32;
``d_max`` / ``n_max`` mask the padding of the head dim (to a power of two) and of the token count.

Offsets: every kernel takes its program ids through ``pid64`` (int64), so every base offset built from them
(``program x stride``, ``(batch x heads + head) x chunk size``) is 64-bit: a (B, N, C) activation passes 2^31
elements from about batch 30 at 2048 px.  ``tests/test_triton_int64.py`` checks this statically for every kernel
file and runs ``base_offset`` past 2^31 in the interpreter.
"""
import inspect
from typing import Tuple

import torch
import triton
import triton.language as tl

__all__ = ["UNSPECIALISED", "jit_sizes", "pid64", "base_offset", "prec", "dot_prec", "block_d", "wstrides", "load_tile", "load_tile_raw", "store_tile", "atomic_add_mat", "dot_acc", "load_tile_pair", "load_mat",
           "store_mat", "tile_rows"]


# argument names of sizes that change with the image, the batch or the model (tokens, map height / width, batch,
# the program counts built from them, heads): not specialised, so one compiled variant per dtype and head dim serves
# every image size (tests/test_compiled_variants.py and experiments/compiled_variants_registry.py count them)
UNSPECIALISED = ("B", "N", "Hh", "Ww", "HEADS", "n_chunks", "n_pchunks", "n_tiles", "n_ptiles", "n_sw", "n_wb")


def jit_sizes(fn=None, *, also: Tuple[str, ...] = (), strides: Tuple[str, ...] = ()):
    """``triton.jit`` with ``do_not_specialize`` on the arguments of ``fn`` named in ``UNSPECIALISED`` and in ``also``
    (a kernel's own arguments that vary with the token count, e.g. the batch stride of a per-token tensor), and
    ``do_not_specialize_on_alignment`` on ``strides`` (strides that follow the map size: their divisibility by 16
    varies, while a stride of 1, a contiguous axis, stays specialised)."""
    if fn is None:
        return lambda f: jit_sizes(f, also=also, strides=strides)
    names = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[a for a in UNSPECIALISED + tuple(also) if a in names],
                      do_not_specialize_on_alignment=[a for a in strides if a in names])


def prec(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: IEEE fp32 for fp32/fp64 inputs, TF32 for fp16/bf16 inputs."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def dot_prec(dtype: torch.dtype) -> str:
    """``tl.dot`` precision of kernels that multiply their inputs as loaded (fp16/bf16 operands run on tensor cores
    whatever this says): fp32 operands in IEEE fp32 unless the user enabled TF32 for matmuls
    (``torch.backends.cuda.matmul.allow_tf32``)."""
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def block_d(d: int) -> int:
    """The head dim padded to a power of two >= 16 (the smallest ``tl.dot`` operand)."""
    return max(16, triton.next_power_of_2(d))


def wstrides(w: torch.Tensor):
    """Strides of a (B | 1, heads, d, d) weight; a leading 1 broadcasts over the batch (stride 0)."""
    sb = 0 if w.shape[0] == 1 else w.stride(0)
    return sb, w.stride(1), w.stride(2), w.stride(3)


@triton.jit
def pid64(axis: tl.constexpr):
    """This program's id along ``axis`` as int64: every offset computed from it is 64-bit."""
    return tl.program_id(axis).to(tl.int64)


@triton.jit
def base_offset(index, stride):
    """index x stride in int64 (either operand may be int32)."""
    return index.to(tl.int64) * stride


@triton.jit
def tile_rows(chunk, t, TILES, BLOCK_N: tl.constexpr):
    """Token rows of tile ``t`` of reduction chunk ``chunk`` (TILES tiles of BLOCK_N tokens)."""
    return (chunk * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def load_tile_raw(ptr, base, offs_r, offs_c, sr, sc, r_max, c_max):
    """A masked 2-D tile in the tensor's own dtype (zeros outside): what the fused kernels feed ``tl.dot``."""
    m = (offs_r[:, None] < r_max) & (offs_c[None, :] < c_max)
    return tl.load(ptr + base + offs_r[:, None] * sr + offs_c[None, :] * sc, mask=m, other=0.0)


@triton.jit
def load_tile(ptr, base, offs_n, offs_d, sn, sd, n_max, d_max):
    """:func:`load_tile_raw` upcast to fp32."""
    return load_tile_raw(ptr, base, offs_n, offs_d, sn, sd, n_max, d_max).to(tl.float32)


@triton.jit
def load_tile_pair(X, Y, xbase, ybase, offs_n, offs_x, offs_y, sxn, sxd, syn, syd, n_max, d_max):
    """The same token rows of two tensors (columns ``offs_x`` of X, ``offs_y`` of Y)."""
    x = load_tile(X, xbase, offs_n, offs_x, sxn, sxd, n_max, d_max)
    y = load_tile(Y, ybase, offs_n, offs_y, syn, syd, n_max, d_max)
    return x, y


@triton.jit
def store_tile(ptr, base, val, offs_n, offs_d, sn, sd, n_max, d_max):
    m = (offs_n[:, None] < n_max) & (offs_d[None, :] < d_max)
    tl.store(ptr + base + offs_n[:, None] * sn + offs_d[None, :] * sd, val.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def load_mat(ptr, base, offs_r, offs_c, sr, sc, d_max):
    """Rows ``offs_r`` x columns ``offs_c`` of a d x d matrix."""
    m = (offs_r[:, None] < d_max) & (offs_c[None, :] < d_max)
    return tl.load(ptr + base + offs_r[:, None] * sr + offs_c[None, :] * sc, mask=m, other=0.0).to(tl.float32)


@triton.jit
def store_mat(ptr, base, val, offs_r, offs_c, d_max):
    """Into a contiguous d x d matrix (a fp32 partial)."""
    m = (offs_r[:, None] < d_max) & (offs_c[None, :] < d_max)
    tl.store(ptr + base + offs_r[:, None] * d_max + offs_c[None, :], val, mask=m)


@triton.jit
def atomic_add_mat(ptr, base, val, offs_d, D):
    """Relaxed fp32 atomic add of a d x d tile into a contiguous d x d matrix (no fences)."""
    m = (offs_d[:, None] < D) & (offs_d[None, :] < D)
    tl.atomic_add(ptr + base + offs_d[:, None] * D + offs_d[None, :], val, mask=m, sem="relaxed")


@triton.jit
def dot_acc(a, b, PREC: tl.constexpr):
    """a @ b on a's dtype (b cast to it), fp32 accumulation."""
    return tl.dot(a, b.to(a.dtype), input_precision=PREC, out_dtype=tl.float32)
