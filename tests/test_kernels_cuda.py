"""GPU-only kernel checks (marker ``cuda``, run by ``tools/gpu_check.py``; skipped without CUDA).

Every registered op with a kernel, forced to it, against its PyTorch path in float32 on float32 copies of the same
(rounded) data, forward and every input gradient, in float32, float16 and bfloat16: large head dims, N in the tens
of thousands, non-contiguous inputs and a head dim in every launch-config class (the kernels pick tile sizes and
warps from the head dim padded to 16/32/64/128; above 64 the ViT3 kernels split columns).  Test ids name the op, so
``gpu_check`` can tell which ops passed.  ``TTT_ZOO_CUDA_TESTS_DEVICE=cpu`` (its dry run) runs them on the CPU in
the interpreter at tiny shapes instead.
"""
import os

import pytest
import torch

from ttt_zoo.kernels import available_ops, get_op
from ttt_zoo.kernels.backend import MAX_HEAD_DIM, TRITON_BACKEND, triton_unsupported
# max |kernel - reference| / max |reference|, per output and gradient: the one table, the local check's too
from ttt_zoo.kernels.verify import CASES as CHECK_CASES, HEAD_DIM_AT, TOL

BUILD = {op: case[0] for op, case in CHECK_CASES.items()}  # each op's input builder, the local check's

DEVICE = os.environ.get("TTT_ZOO_CUDA_TESTS_DEVICE", "cuda")
TINY = DEVICE != "cuda"
RUNNABLE = torch.cuda.is_available() if DEVICE == "cuda" else triton_unsupported(torch.device(DEVICE)) is None
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not RUNNABLE, reason=f"the kernels cannot run on {DEVICE} here")]

DTYPES = {"fp32": torch.float32} if TINY else {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# op -> (input builder, GPU cases, tiny case): heads ops (B, heads, N, d); dwconv (B, d, H, W); qkv (B, heads, H, W, d);
# key norm and adaLN (B, N, C); scans (B, heads, N, d, mini_batch)
_HEADS = [(1, 2, 20000, 64), (1, 2, 20000, 32), (1, 1, 16500, 128)] + [(2, 2, 999, d) for d in
                                                                         (16, 24, 32, 48, 64, 72, 96, 128)]
_QKV = [(1, 3, 128, 160, 64), (2, 2, 17, 19, 128), (2, 3, 14, 14, 32), (2, 2, 15, 13, 72), (3, 4, 9, 7, 16)]
_SCAN = [(1, 2, 20000, 64, 16), (2, 2, 999, 16, 8), (2, 2, 999, 32, 16), (2, 2, 999, 48, 16), (2, 3, 999, 64, 64)]
CASES = {
    "vit3_swiglu_ttt": (BUILD["vit3_swiglu_ttt"], _HEADS, (1, 2, 21, 16)),
    "vit3_dwconv_ttt": (BUILD["vit3_dwconv_ttt"], [(1, 64, 160, 128), (2, 8, 33, 31), (2, 96, 17, 23)],
                        (1, 4, 5, 7)),
    "vit3_qkv_ttt": (BUILD["vit3_qkv_ttt"], _QKV, (1, 2, 4, 3, 8)),
    "vit3_variant_qkv_ttt": (BUILD["vit3_variant_qkv_ttt"], _QKV, (1, 2, 4, 3, 8)),
    "t5_swiglu_ttt": (BUILD["t5_swiglu_ttt"], _HEADS, (1, 2, 21, 16)),
    "dit5_mlp_ttt": (BUILD["dit5_mlp_ttt"], _HEADS, (1, 2, 21, 16)),
    "key_instance_norm": (BUILD["key_instance_norm"], [(1, 20000, 192), (2, 999, 72), (3, 77, 16)],
                          (2, 9, 12)),
    "adaln_modulate": (BUILD["adaln_modulate"], [(1, 20000, 384), (8, 256, 1152), (2, 999, 72), (3, 77, 16)],
                       (2, 9, 24)),
    "mlp_gelu": (BUILD["mlp_gelu"], [(1, 20000, 1536), (2, 999, 72), (3, 77, 16)], (2, 9, 24)),
    "ttt_linear": (BUILD["ttt_linear"], _SCAN, (1, 1, 21, 16, 8)),
    "ttt_linear_bidir": (BUILD["ttt_linear_bidir"], _SCAN, (1, 1, 21, 16, 8)),
    "linear_attention_bidir": (BUILD["linear_attention_bidir"], _SCAN, (1, 1, 21, 16, 8)),
    "linear_attention": (BUILD["linear_attention"], [(1, 2, 20000, 64, 16), (2, 2, 999, 16, 16), (2, 2, 999, 128, 16)],
                         (1, 1, 21, 16, 8)),
}
KERNEL_OPS = sorted(op for op, impls in available_ops().items() if impls[TRITON_BACKEND])


def _within_limit(op, shape):
    """The kernel takes this head dim (``backend.MAX_HEAD_DIM``; above it, forcing the kernel is refused, which
    ``tests/test_op_inner_mlp.py`` checks)."""
    limit = MAX_HEAD_DIM.get(op)
    return limit is None or shape[HEAD_DIM_AT.get(op, -1)] <= limit


def _cases(strided=False):
    """(op, shape) params, ids starting with the op; non-contiguous: one case per op (the last, a small one)."""
    for op in KERNEL_OPS:
        if op not in CASES:  # a new kernel without cases fails, it is not skipped
            yield pytest.param(op, None, id=f"{op}-no_cases")
            continue
        shapes = [s for s in CASES[op][1] if _within_limit(op, s)]
        shapes = [CASES[op][2]] if TINY else shapes[-1:] if strided else shapes
        for shape in shapes:
            yield pytest.param(op, shape, id=f"{op}-{'x'.join(map(str, shape))}")


def _inputs(op, shape, dtype, strided):
    """(kernel inputs, fp32 reference inputs): activations in ``dtype``, inner weights fp32 as the layers keep them;
    ``strided``: activations as column-major views (same values, not contiguous)."""
    g = torch.Generator().manual_seed(0)
    weights = set()

    def rnd(*size, scale=1.0, shift=0.0, weight=False, uniform=False):
        t = (torch.rand(*size, generator=g) if uniform else torch.randn(*size, generator=g)) * scale + shift
        if weight:
            weights.add(id(t))
        return t

    args = CASES[op][0](shape, rnd)
    new, ref = [], []
    for a in args:
        if not isinstance(a, torch.Tensor):
            new.append(a)
            ref.append(a)
            continue
        t = a.to(DEVICE, torch.float32 if id(a) in weights else dtype)
        if strided and t.dim() >= 2 and id(a) not in weights:
            t = _non_contiguous(t)
        new.append(t.requires_grad_())
        ref.append(t.detach().float().requires_grad_())
    return new, ref


def _non_contiguous(t):
    """The same values as a transposed (column-major) view, or as a slice of wider rows where that is contiguous."""
    v = t.mT.contiguous().mT
    if v.is_contiguous():
        v = torch.cat([t, t[..., :3]], dim=-1)[..., :t.shape[-1]]
    return v


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _check(op, shape, dtype, strided):
    assert shape is not None, f"op {op!r} has a kernel but no cases in {__file__}"
    new, ref = _inputs(op, shape, dtype, strided)
    dev = torch.device(DEVICE)
    out = _first(get_op(op, dev, TRITON_BACKEND, dtype)(*new))
    expected = _first(get_op(op, dev, "torch", torch.float32)(*ref))
    assert out.dtype == dtype and out.shape == expected.shape
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    leaves = [i for i, t in enumerate(new) if isinstance(t, torch.Tensor)]
    grads = torch.autograd.grad(out, [new[i] for i in leaves], grad_out.to(dtype), allow_unused=True)
    ref_grads = torch.autograd.grad(expected, [ref[i] for i in leaves], grad_out, allow_unused=True)
    named = [("out", out, expected)] + [(f"grad of input {i}", a, b) for i, a, b in zip(leaves, grads, ref_grads)]
    for name, a, b in named:
        if b is None:
            continue
        assert a is not None and a.shape == b.shape, name
        assert torch.isfinite(a).all(), f"{name}: not finite"
        err = ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
        assert err <= TOL[dtype], f"{op} {shape} {dtype} {name}: relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("op,shape", list(_cases()))
def test_kernel_matches_pytorch(op, shape, dtype):
    _check(op, shape, dtype, strided=False)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("op,shape", list(_cases(strided=True)))
def test_kernel_on_non_contiguous_inputs(op, shape, dtype):
    _check(op, shape, dtype, strided=True)
