"""The ViT3 / H-ViT3 / DiT3 inner-step op (``kernels/vit3_ttt``): every path against the reference.

torch (the recomputing backward) against gradcheck in float64 and the naive reference under autograd; the Triton
kernels (under TRITON_INTERPRET=1 without a GPU) against the reference, forward and every input/weight gradient,
tight in float32, looser in float16 (bf16 is not tested: the interpreter's bf16 arithmetic is wrong), with small
tiles patched in so that tiny shapes span several programs, partial tiles and multi-tile chunks (N % BLOCK != 0,
H != W, head dims 32/64/72, batch 1/3); the backend decision, torch.compile, the meta device, an empty batch and the
ttt_zoo::vit3_* custom ops (gradcheck, opcheck); the fused mixer-core op (``fused.py``) against float64 at N in the
thousands (fp32, fp16) and its launch count (3 Triton kernels each way, no aten kernel).
"""
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _ops import BACKENDS, DEV, META_BACKENDS, TRITON_OK, compare_kernel, triton_kernels, triton_test
from ttt_zoo.kernels import available_ops, dwconv_ttt, get_op, swiglu_ttt, vit3_qkv_ttt
from ttt_zoo.kernels.vit3_ttt import ops, qkv_ttt_op
from ttt_zoo.kernels.vit3_ttt.naive import dwconv_ttt_reference, qkv_ttt_naive, swiglu_ttt_reference
from ttt_zoo.kernels.vit3_ttt.torch import (dwconv_ttt_torch, normalize_columns, normalize_columns_bwd, qkv_ttt_torch,
                                            swiglu_ttt_torch)
from ttt_zoo.layers import ViT3TTT
from ttt_zoo.layers.rope import rope_2d_tables

T = triton_kernels("vit3_ttt")
FUSED = importlib.import_module("ttt_zoo.kernels.vit3_ttt.fused") if T is not None else None


def _leaves(*shapes, dtype=torch.float64, scale=1.0):
    return [(torch.randn(*s, dtype=dtype) * scale).requires_grad_() for s in shapes]


def _grads_close(f_new, f_ref, inputs, **tol):
    out_new, out_ref = f_new(*inputs), f_ref(*inputs)
    torch.testing.assert_close(out_new, out_ref, **tol)
    do = torch.randn_like(out_ref)
    g_new = torch.autograd.grad(out_new, inputs, do)
    g_ref = torch.autograd.grad(out_ref, inputs, do)
    for a, b in zip(g_new, g_ref):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("per_sample", [False, True])
def test_swiglu_gradcheck(normalize, per_sample):
    b, h, n, d = 2, 2, 7, 5
    wb = b if per_sample else 1
    inputs = _leaves((b, h, n, d), (b, h, n, d), (b, h, n, d)) + _leaves((wb, h, d, d), (wb, h, d, d), scale=0.3)
    assert torch.autograd.gradcheck(lambda *a: swiglu_ttt_torch(*a, 0.7, normalize), inputs)


@pytest.mark.parametrize("normalize", [True, False])
def test_dwconv_gradcheck(normalize):
    inputs = _leaves((2, 2, 3, 4), (2, 2, 3, 4), (2, 2, 3, 4), (2, 1, 3, 3))
    assert torch.autograd.gradcheck(lambda *a: dwconv_ttt_torch(*a, 0.7, normalize), inputs)


def test_column_norm_bwd_at_zero_column():
    # a zero column (norm 0) must give the autograd subgradient of torch's norm, not NaN
    g = torch.randn(3, 4, dtype=torch.float64)
    g[:, 1] = 0
    g.requires_grad_()
    dghat = torch.randn(3, 4, dtype=torch.float64)
    (ref,) = torch.autograd.grad(normalize_columns(g), g, dghat)
    torch.testing.assert_close(normalize_columns_bwd(g.detach(), dghat), ref)


def _qkv_leaves(h, w, rope, b=2, heads=2, d=4):
    """float64 leaves (x, weight, bias, w1, w2, w3) of a small mixer core on an h x w map, and its RoPE tables (or
    None, None)."""
    c = heads * d
    x, weight, bias = _leaves((b, h * w, c), (3 * c + 3 * d, c), (3 * c + 3 * d,), scale=0.5)
    w1, w2, w3 = _leaves((1, heads, d, d), (1, heads, d, d), (d, 1, 3, 3), scale=0.3)
    cos, sin = [t.double() for t in rope_2d_tables((h, w), c)] if rope else (None, None)
    return (x, weight, bias, w1, w2, w3), cos, sin


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("rope", [False, True])
def test_qkv_gradcheck(rope, recompute):
    """Both backward sources of the inner steps' inputs: the projection recomputed, or its output kept."""
    heads, h, w = 2, 3, 4
    args, cos, sin = _qkv_leaves(h, w, rope, heads=heads, b=2)
    f = lambda *a: qkv_ttt_torch(*a, (h, w), heads, 0.7, True, cos, sin, recompute=recompute)  # noqa: E731
    assert torch.autograd.gradcheck(f, args, fast_mode=True)
    torch.testing.assert_close(f(*args), qkv_ttt_naive(*args, (h, w), heads, 0.7, True, cos, sin))


def test_qkv_without_bias_gradcheck():
    b, heads, d, h, w = 1, 2, 4, 2, 3
    c = heads * d
    x, weight = _leaves((b, h * w, c), (3 * c + 3 * d, c), scale=0.5)
    w1, w2, w3 = _leaves((1, heads, d, d), (1, heads, d, d), (d, 1, 3, 3), scale=0.3)
    f = lambda x, wt, w1, w2, w3: qkv_ttt_torch(x, wt, None, w1, w2, w3, (h, w), heads, 0.7)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, weight, w1, w2, w3), fast_mode=True)


@pytest.mark.parametrize("shape", [(1, 6, 49, 32), (3, 2, 20, 72)])
def test_swiglu_matches_naive_float32(shape):
    b, h, n, d = shape
    inputs = _leaves(shape, shape, shape, dtype=torch.float32) + _leaves((1, h, d, d), (1, h, d, d),
                                                                            dtype=torch.float32, scale=0.02)
    _grads_close(lambda *a: swiglu_ttt_torch(*a, 1 / 3), lambda *a: swiglu_ttt_reference(*a, 1 / 3), inputs,
                 atol=1e-5, rtol=1e-4)


def test_dwconv_matches_naive_float32():
    inputs = _leaves((3, 32, 5, 9), (3, 32, 5, 9), (3, 32, 5, 9), dtype=torch.float32) + _leaves(
        (32, 1, 3, 3), dtype=torch.float32, scale=0.02)
    _grads_close(lambda *a: dwconv_ttt_torch(*a, 1 / 3), lambda *a: dwconv_ttt_reference(*a, 1 / 3), inputs,
                 atol=1e-5, rtol=1e-4)


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("rope", [False, True])
def test_mixer_backends_agree(rope):
    # the whole mixer (projection, RoPE, both branches, proj): recomputing path vs. naive autograd, float32
    torch.manual_seed(0)
    m = ViT3TTT(32, num_heads=2, rope=rope)
    x = torch.randn(2, 5 * 7, 32, requires_grad=True)
    outs, grads = {}, {}
    for backend in BACKENDS:
        m.backend = backend
        out = m(x, (5, 7))
        outs[backend] = out
        grads[backend] = torch.autograd.grad(out.square().sum(), [x] + list(m.parameters()))
    for backend in set(BACKENDS) - {"torch_naive"}:  # 'triton' on CPU: the kernels in the interpreter
        torch.testing.assert_close(outs[backend], outs["torch_naive"], atol=1e-5, rtol=1e-4)
        for a, b in zip(grads[backend], grads["torch_naive"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_low_precision_inputs_compute_in_float32():
    q, k, v = [torch.randn(1, 2, 9, 8) for _ in range(3)]
    w1, w2 = [torch.randn(1, 2, 8, 8) * 0.1 for _ in range(2)]
    ref = swiglu_ttt_reference(q, k, v, w1, w2, 1 / 3)
    half = [t.half().requires_grad_() for t in (q, k, v, w1, w2)]
    out = swiglu_ttt_torch(*half, 1 / 3)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.float16 and torch.isfinite(t.grad).all() for t in half)


def test_dispatch_backends(monkeypatch):
    dev = torch.device("cpu")
    assert get_op("vit3_swiglu_ttt", dev) is swiglu_ttt_torch
    assert get_op("vit3_swiglu_ttt", dev, "torch_naive") is swiglu_ttt_reference
    monkeypatch.setenv("TTT_ZOO_BACKEND", "torch_naive")
    assert get_op("vit3_dwconv_ttt", dev) is dwconv_ttt_reference
    monkeypatch.setenv("TTT_ZOO_BACKEND", "bogus")
    with pytest.raises(ValueError, match="TTT_ZOO_BACKEND"):
        get_op("vit3_dwconv_ttt", dev)
    assert available_ops()["vit3_qkv_ttt"]["torch_naive"]


def test_custom_ops_are_registered_and_differentiable():
    assert hasattr(torch.ops.ttt_zoo, "vit3_swiglu_fwd") and hasattr(torch.ops.ttt_zoo, "vit3_dwconv_bwd")
    b, h, n, d = 2, 2, 5, 4
    inputs = _leaves((b, h, n, d), (b, h, n, d), (b, h, n, d)) + _leaves((1, h, d, d), (1, h, d, d), scale=0.3)
    assert torch.autograd.gradcheck(lambda *a: ops.swiglu_ttt_op(*a, 0.7), inputs, fast_mode=True)
    inputs = _leaves((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), (2, 1, 3, 3))
    assert torch.autograd.gradcheck(lambda *a: ops.dwconv_ttt_op(*a, 0.7), inputs, fast_mode=True)
    # the fake (meta) kernels agree with the real ones on shapes/dtypes
    torch.library.opcheck(torch.ops.ttt_zoo.vit3_swiglu_fwd.default,
                          [torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8),
                           torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8), 0.5, True, False],
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch_naive"])
def test_dispatch_under_torch_compile(backend):
    # explicit devices, no torch.device context: torch 2.11's dynamo cannot trace Tensor.unflatten under one (the
    # H200 lease of 2026-11-26); torch 2.14 can
    torch._dynamo.reset()
    m = ViT3TTT(32, num_heads=2, backend=backend).to(DEV)
    x = torch.randn(1, 12, 32, device=DEV, requires_grad=True)
    fn = torch.compile(lambda t: m(t, (3, 4)), backend="aot_eager", fullgraph=True)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # CUDA: both sides in full fp32
        out = fn(x)
        gx = torch.autograd.grad(out.square().sum(), x)[0]
        ref = m(x, (3, 4))
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(gx, torch.autograd.grad(ref.square().sum(), x)[0])


@pytest.mark.parametrize("backend", META_BACKENDS)
def test_meta_device(backend):
    with torch.device("meta"):
        m = ViT3TTT(64, num_heads=2, backend=backend, rope=True)
        x = torch.randn(2, 4 * 6, 64, requires_grad=True)
    out = m(x, (4, 6))
    assert out.device.type == "meta" and out.shape == (2, 24, 64)
    out.sum().backward()
    assert x.grad.shape == x.shape and m.w1.grad.shape == m.w1.shape and m.qkv.weight.grad.device.type == "meta"


@pytest.mark.usefixtures("kernel_device")
def test_public_wrappers_match_reference():
    q, k, v = [torch.randn(2, 3, 10, 8) for _ in range(3)]
    w1, w2 = [torch.randn(1, 3, 8, 8) * 0.1 for _ in range(2)]
    torch.testing.assert_close(swiglu_ttt(q, k, v, w1, w2, 1 / 3), swiglu_ttt_reference(q, k, v, w1, w2, 1 / 3))
    q, k, v = [torch.randn(2, 8, 3, 5) for _ in range(3)]
    w3 = torch.randn(8, 1, 3, 3)
    for backend in BACKENDS:
        torch.testing.assert_close(dwconv_ttt(q, k, v, w3, 1 / 3, backend=backend),
                                   dwconv_ttt_reference(q, k, v, w3, 1 / 3), atol=1e-5, rtol=1e-4)
    x = torch.randn(1, 6, 16)
    wt, w1, w2, w3 = [torch.randn(*s) * 0.2 for s in ((3 * 16 + 24, 16), (1, 2, 8, 8), (1, 2, 8, 8), (8, 1, 3, 3))]
    torch.testing.assert_close(vit3_qkv_ttt(x, wt, None, w1, w2, w3, (2, 3), 2, 1 / 3),
                               qkv_ttt_naive(x, wt, None, w1, w2, w3, (2, 3), 2, 1 / 3), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------ Triton kernels
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    if DEV == "cpu" and T is not None:  # the interpreter is slow: shrink tiles so that tiny inputs still exercise the tiling logic
        monkeypatch.setattr(T, "BLOCK_N", 16)
        monkeypatch.setattr(T, "TILES", 2)
        monkeypatch.setattr(T, "BLOCK_P", 32)
        monkeypatch.setattr(T, "MAX_COLS", 32)   # d = 64 and 72 run as several column blocks, d = 32 as one
        monkeypatch.setattr(T, "COL_BLOCK", 16)


def _compare(f_new, f_ref, inputs, dtype):
    compare_kernel(f_new, f_ref, inputs, dtype, "q k v w1 w2 w3".split(), TOL)


SWIGLU_CASES = [  # (B, heads, N, d, per-sample weights)
    (1, 2, 37, 32, False),   # N not a multiple of the tile, 3 chunks
    (3, 1, 21, 64, True),    # batch 3, per-sample inner weights
    (1, 1, 18, 72, False),   # head dim 72 (padded to 128)
]


@pytest.mark.parametrize("case", SWIGLU_CASES, ids=lambda c: "B{}h{}N{}d{}{}".format(*c[:4], "ps" if c[4] else ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_swiglu_kernels(case, dtype):
    b, h, n, d, per_sample = case
    if dtype == torch.float16 and d == 72:
        pytest.skip("covered in fp32; keeps the interpreter run short")
    wb = b if per_sample else 1
    inputs = [torch.randn(b, h, n, d, device=DEV) for _ in range(3)]
    inputs += [torch.randn(wb, h, d, d, device=DEV) * 0.05 for _ in range(2)]
    _compare(lambda *a: T.swiglu_ttt_triton(*a, 1 / 3), lambda *a: swiglu_ttt_reference(*a, 1 / 3), inputs, dtype)


@triton_test
def test_swiglu_kernels_no_normalisation():
    inputs = [torch.randn(1, 1, 20, 32, device=DEV) for _ in range(3)]
    inputs += [torch.randn(1, 1, 32, 32, device=DEV) * 0.05 for _ in range(2)]
    _compare(lambda *a: T.swiglu_ttt_triton(*a, 0.5, False), lambda *a: swiglu_ttt_reference(*a, 0.5, False),
             inputs, torch.float32)


@pytest.mark.parametrize("shape", [(1, 32, 7, 5), (3, 4, 9, 12)], ids=["B1d32H7W5", "B3d4H9W12"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_dwconv_kernels(shape, dtype):
    b, d, h, w = shape
    inputs = [torch.randn(*shape, device=DEV) for _ in range(3)] + [torch.randn(d, 1, 3, 3, device=DEV) * 0.05]
    _compare(lambda *a: T.dwconv_ttt_triton(*a, 1 / 3), lambda *a: dwconv_ttt_reference(*a, 1 / 3), inputs, dtype)


@triton_test
def test_dwconv_kernels_strided_views():
    # the mixer hands the conv branch transposed views of the qkv output: no copy, arbitrary strides
    b, h, w, d = 2, 5, 6, 8
    qkv = torch.randn(b, h * w, 3 * d + 5, device=DEV)
    q, k, v = [qkv[..., i * d:(i + 1) * d].transpose(1, 2).reshape(b, d, h, w) for i in range(3)]
    assert not q.is_contiguous()
    w3 = torch.randn(d, 1, 3, 3, device=DEV) * 0.05
    out, _ = T.dwconv_fwd_triton(q, k, v, w3, 1 / 3)
    torch.testing.assert_close(out, dwconv_ttt_reference(q, k, v, w3, 1 / 3), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_dwconv_kernels_token_major_views_long(dtype):
    """The conv step as DiT3-XL's per-branch mixer core runs it: head dim 72 (three channel blocks, the last one
    partial), the projection's token-major views (channels contiguous, no copy), N = 56 x 56 = 3136; output, dx and
    dw3 against the float64 reference."""
    b, h, w, d = 1, 56, 56, 72
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(b, h * w, 3 * d, generator=gen)
    w3 = torch.randn(d, 1, 3, 3, generator=gen) * 0.05
    dout = torch.randn(b, h * w, d, generator=gen)

    def run(x, wt, do, f):
        x, wt = x.requires_grad_(), wt.requires_grad_()
        maps = [x[..., i * d:(i + 1) * d].transpose(1, 2).unflatten(-1, (h, w)) for i in range(3)]
        out = f(*maps, wt, 1 / 3)
        return (out, *torch.autograd.grad(out, [x, wt], do.transpose(1, 2).unflatten(-1, (h, w))))

    new = run(proj.to(DEV, dtype), w3.to(DEV), dout.to(DEV, dtype), T.dwconv_ttt_triton)
    ref = run(proj.to(dtype).double(), w3.double(), dout.to(dtype).double(), dwconv_ttt_reference)
    for name, x, r in zip(("out", "dx", "dw3"), new, ref):
        scale = r.abs().max()
        torch.testing.assert_close(x.double().cpu() / scale, r / scale, **TOL[dtype], msg=lambda m: f"{name}: {m}")


@triton_test
@pytest.mark.parametrize("recompute", [True, False])
def test_qkv_triton_path_with_rope(recompute):
    # projection + RoPE + both branches through the fused op (qkv_ttt_op, triton=True), vs. the naive composition;
    # the backward recomputes the projection or takes its kept output
    b, heads, d, h, w = 1, 2, 32, 3, 5
    c = heads * d
    cos, sin = [t.to(DEV) for t in rope_2d_tables((h, w), c)]
    inputs = [torch.randn(b, h * w, c, device=DEV), torch.randn(3 * c + 3 * d, c, device=DEV) * 0.1,
              torch.randn(3 * c + 3 * d, device=DEV) * 0.1, torch.randn(1, heads, d, d, device=DEV) * 0.05,
              torch.randn(1, heads, d, d, device=DEV) * 0.05, torch.randn(d, 1, 3, 3, device=DEV) * 0.05]
    _compare(lambda *a: qkv_ttt_op(*a, (h, w), heads, 1 / 3, True, cos, sin, triton=True, recompute=recompute),
             lambda *a: qkv_ttt_naive(*a, (h, w), heads, 1 / 3, True, cos, sin), inputs, torch.float32)


@triton_test
def test_qkv_triton_path_above_the_fused_head_dims():
    # d = 72 (DiT3-XL): the fused kernels stop at 64 (shared memory, spills); the per-branch kernels run instead
    b, heads, d, h, w = 1, 1, 72, 3, 4
    c = heads * d
    inputs = [torch.randn(b, h * w, c, device=DEV), torch.randn(3 * c + 3 * d, c, device=DEV) * 0.1,
              torch.randn(3 * c + 3 * d, device=DEV) * 0.1, torch.randn(1, heads, d, d, device=DEV) * 0.05,
              torch.randn(1, heads, d, d, device=DEV) * 0.05, torch.randn(d, 1, 3, 3, device=DEV) * 0.05]
    _compare(lambda *a: qkv_ttt_op(*a, (h, w), heads, 1 / 3, True, triton=True),
             lambda *a: qkv_ttt_naive(*a, (h, w), heads, 1 / 3, True), inputs, torch.float32)


# ------------------------------------------------ the fused mixer-core op (fused.py) at real N, vs. float64
def _fused_tol(dtype: torch.dtype, n: int) -> float:
    """Max error allowed relative to the reference's largest magnitude: each dot operand rounded to the input dtype
    a few times along the chain (4 eps of the dtype) plus fp32 accumulation over the longest reduction (N terms:
    the random-rounding bound sqrt(N) eps_fp32, twice)."""
    return 4 * torch.finfo(dtype).eps + 2 * math.sqrt(n) * torch.finfo(torch.float32).eps


def _six_views(qkv, heads, d, h, w):
    return ops._qkv_views(qkv, heads, d, h, w)


FUSED_CASES = [  # (B, heads, d, H, W, per-batch weights, normalize_grad, dtype)
    (1, 1, 32, 56, 56, False, True, torch.float32),   # N = 3136: ViT3 at 224 px, stride 4
    (1, 1, 32, 56, 56, False, True, torch.float16),
    (1, 1, 64, 56, 56, False, True, torch.float32),   # head dim 64: two conv channel blocks, 32-token tiles
    (1, 1, 64, 56, 56, False, True, torch.float16),
    (2, 1, 24, 40, 30, True, True, torch.float32),    # a head dim that is not a power of two, per-batch weights
    (2, 1, 24, 40, 30, False, False, torch.float16),  # shared weights summed over the batch, no normalisation
]


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: "B{}h{}d{}_{}x{}{}{}_{}".format(
    *c[:5], "_perbatch" if c[5] else "", "" if c[6] else "_nonorm", str(c[7])[6:]))
@triton_test
def test_fused_qkv_op_matches_float64(case, monkeypatch):
    """out, dqkv, dw1, dw2, dw3 of ``vit3_qkv_fwd`` (the fused kernels, through its autograd) against the float64
    reference on the same rounded inputs, at N in the thousands; activations in ``dtype``, weights fp32 (as in a
    model under autocast)."""
    if DEV == "cpu":  # the interpreter: fewer, larger conv programs
        monkeypatch.setattr(FUSED, "BLOCK_P", 1024)
        monkeypatch.setattr(FUSED, "TILES", 2)
    b, heads, d, h, w, per_batch, normalize, dtype = case
    torch.manual_seed(0)
    c, wb = heads * d, b if per_batch else 1
    qkv = torch.randn(b, h * w, 3 * c + 3 * d, device=DEV).to(dtype).requires_grad_()
    ws = [(torch.randn(wb, heads, d, d, device=DEV) * 0.05).requires_grad_() for _ in range(2)]
    ws.append((torch.randn(d, 1, 3, 3, device=DEV) * 0.05).requires_grad_())
    out, *_ = ops.qkv_fwd_op(*_six_views(qkv, heads, d, h, w), *ws, 1 / 3, normalize, None, None, True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [qkv] + ws, dout)

    ref_leaves = [t.detach().double().requires_grad_() for t in [qkv] + ws]
    q1, k1, v1, q2, k2, v2 = _six_views(ref_leaves[0], heads, d, h, w)
    r1 = swiglu_ttt_reference(q1, k1, v1, *ref_leaves[1:3], 1 / 3, normalize)
    r2 = dwconv_ttt_reference(q2, k2, v2, ref_leaves[3], 1 / 3, normalize)
    ref = torch.cat([r1.transpose(1, 2).flatten(2), r2.flatten(2).transpose(1, 2)], -1)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    tol = _fused_tol(dtype, h * w)
    for name, got, want in [("out", out, ref)] + list(zip(["dqkv", "dw1", "dw2", "dw3"], grads, ref_grads)):
        assert got.dtype == (dtype if name in ("out", "dqkv") else torch.float32) and got.shape == want.shape, name
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        print(f"{name}: max error / max |ref| = {err:.2e} (tolerance {tol:.2e})")
        assert err <= tol, (name, err, tol)


ROPE_CASES = [  # (B, heads, d, H, W, dtype): H-ViT3-T's first stage at 224 px (56 x 56 = 3136 tokens, d = 32)
    (1, 2, 32, 56, 56, torch.float32),
    (1, 2, 32, 56, 56, torch.float16),
    (1, 1, 64, 48, 40, torch.float16),  # d = 64 (16-token tiles), H != W
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: "B{}h{}d{}_{}x{}_{}".format(*c[:5], str(c[5])[6:]))
@triton_test
def test_fused_qkv_op_with_rope_matches_float64(case, monkeypatch):
    """H-ViT3's mixer core with the 2-D RoPE turned inside the fused kernels (q, k as loaded; dq, dk back as stored):
    out and the gradients of x, the qkv weight and bias, w1, w2, w3 against the float64 reference (``qkv_ttt_naive``:
    the projection, RoPE on q and k in float64, both inner steps) on the same rounded inputs, at N in the thousands;
    no aten RoPE op runs on this path (the launch counts of the block: test_hvit3_launches.py)."""
    if DEV == "cpu":
        monkeypatch.setattr(FUSED, "BLOCK_P", 1024)
        monkeypatch.setattr(FUSED, "TILES", 2)
    b, heads, d, h, w, dtype = case
    torch.manual_seed(0)
    c, n = heads * d, h * w
    cos, sin = (t.to(DEV) for t in rope_2d_tables((h, w), c))
    x = torch.randn(b, n, c, device=DEV).to(dtype)
    weight, bias = (torch.randn(3 * c + 3 * d, c, device=DEV) / math.sqrt(c)).to(dtype), \
        (torch.randn(3 * c + 3 * d, device=DEV) * 0.1).to(dtype)
    ws = [torch.randn(1, heads, d, d, device=DEV) * 0.05 for _ in range(2)] + [torch.randn(d, 1, 3, 3, device=DEV) * 0.05]
    leaves = [t.requires_grad_() for t in [x, weight, bias] + ws]
    out = qkv_ttt_op(*leaves, (h, w), heads, 1 / 3, True, cos, sin, triton=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = qkv_ttt_naive(*ref_leaves, (h, w), heads, 1 / 3, True, cos.double(), sin.double())
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    tol = 2 * _fused_tol(dtype, n)  # one more rounding to ``dtype``: the projection's output
    for name, got, want in [("out", out, ref)] + list(zip(["dx", "dweight", "dbias", "dw1", "dw2", "dw3"], grads,
                                                         ref_grads)):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        print(f"{name}: max error / max |ref| = {err:.2e} (tolerance {tol:.2e})")
        assert err <= tol, (name, err, tol)


def test_qkv_op_torch_path_turns_rope_tables():
    """``vit3_qkv_fwd`` given the RoPE tables on its PyTorch path (the kernels' stand-in off the GPU) equals the op on
    views turned beforehand, and its gradients are the float64 gradcheck's (the cotangents of the unturned views)."""
    b, heads, d, h, w = 2, 2, 4, 3, 4
    c = heads * d
    cos, sin = (t.double() for t in rope_2d_tables((h, w), c))
    qkv = torch.randn(b, h * w, 3 * c + 3 * d, dtype=torch.float64, requires_grad=True)
    ws = _leaves((1, heads, d, d), (1, heads, d, d), (d, 1, 3, 3), scale=0.3)

    def turned_inside(qkv, *ws):
        return ops.qkv_fwd_op(*_six_views(qkv, heads, d, h, w), *ws, 0.7, True, cos, sin, False)[0]

    def turned_before(qkv, *ws):
        q1, k1, *rest = _six_views(qkv, heads, d, h, w)
        q1, k1 = (ops._rope_heads(t, cos, sin, (h, w)) for t in (q1, k1))
        return ops.qkv_fwd_op(q1, k1, *rest, *ws, 0.7, True, None, None, False)[0]
    assert torch.autograd.gradcheck(turned_inside, (qkv, *ws), fast_mode=True)
    _grads_close(turned_inside, turned_before, (qkv, *ws))


def _fused_grads(b, heads, d, h, w, dtype, scale, v_scale=1.0):
    """(inputs, dout, grads of qkv and the weights) of the fused op; the v columns of the SwiGLU branch scaled."""
    torch.manual_seed(0)
    c = heads * d
    qkv = torch.randn(b, h * w, 3 * c + 3 * d, device=DEV)
    qkv[..., 2 * c:3 * c] *= v_scale
    qkv = qkv.to(dtype).requires_grad_()
    ws = [(torch.randn(1, heads, d, d, device=DEV) * 0.05).requires_grad_() for _ in range(2)]
    ws.append((torch.randn(d, 1, 3, 3, device=DEV) * 0.05).requires_grad_())
    out, *_ = ops.qkv_fwd_op(*_six_views(qkv, heads, d, h, w), *ws, scale, True, None, None, True)
    dout = torch.randn_like(out)
    return [qkv] + ws, dout, torch.autograd.grad(out, [qkv] + ws, dout)


@triton_test
def test_fused_backward_fp16_safe_from_subnormal_dg(monkeypatch):
    """c dG (c = -scale / N) is subnormal in fp16 here (~1e-6, a few bits of mantissa) while dk is not (v is large):
    the kernels scale dG to max 1 before it meets the fp16 tiles and apply c max|dG| in fp32.  Multiplying first
    (before the fix) gave dk1 a 6e-2 error; within the fp16 tolerance now."""
    if DEV == "cpu":
        monkeypatch.setattr(FUSED, "BLOCK_P", 256)
        monkeypatch.setattr(FUSED, "TILES", 2)
    b, heads, d, h, w, scale = 1, 1, 32, 56, 56, 1e-4
    leaves, dout, grads = _fused_grads(b, heads, d, h, w, torch.float16, scale, v_scale=64.0)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    q1, k1, v1, q2, k2, v2 = _six_views(ref_leaves[0], heads, d, h, w)
    r1 = swiglu_ttt_reference(q1, k1, v1, *ref_leaves[1:3], scale, True)
    r2 = dwconv_ttt_reference(q2, k2, v2, ref_leaves[3], scale, True)
    ref = torch.cat([r1.transpose(1, 2).flatten(2), r2.flatten(2).transpose(1, 2)], -1)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    c, tol = heads * d, _fused_tol(torch.float16, h * w)
    got_k, want_k = grads[0][..., c:2 * c].double(), ref_grads[0][..., c:2 * c]
    cdg = want_k.abs().max() / (64.0 * math.sqrt(d))  # the order of c dG: dk ~ |v| sqrt(d) |c dG|
    assert cdg < torch.finfo(torch.float16).tiny, cdg.item()  # the case this test is about
    err = ((got_k - want_k).abs().max() / want_k.abs().max()).item()
    assert want_k.abs().max() > 2 * torch.finfo(torch.float16).tiny  # dk itself is a normal fp16 number
    assert err <= tol, (err, tol)
    for got, want in zip(grads[1:3], ref_grads[1:3]):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= tol


@triton_test
def test_fused_backward_deterministic_switch(monkeypatch):
    """Under ``torch.use_deterministic_algorithms`` the weight gradients are summed in a fixed order by a fourth
    launch (bitwise the same run to run) instead of relaxed atomic adds; both agree to fp32 rounding."""
    b, heads, d, h, w = 2, 2, 16, 9, 7
    launches = _count_triton_launches(monkeypatch)
    _, _, fast = _fused_grads(b, heads, d, h, w, torch.float32, 1 / 3)
    assert launches.count("_bwd_reduce") == 0
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    _, _, det = _fused_grads(b, heads, d, h, w, torch.float32, 1 / 3)
    _, _, again = _fused_grads(b, heads, d, h, w, torch.float32, 1 / 3)
    assert launches.count("_bwd_reduce") == 2
    for x, y, z in zip(fast, det, again):
        assert torch.equal(y, z)
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_per_branch_conv_kernels_see_one_layout_at_every_batch():
    """DiT3-XL (head dim 72, above the fused kernels') runs the per-branch kernels: the conv maps reach ``_taps`` and
    ``_dwconv`` as the projection's token-major views at batch 1 and above (no packed NCHW copy at batch > 1, which
    the PyTorch path makes), so each call site compiles once (Triton's compile key on the meta device, no GPU)."""
    from ttt_zoo.bench import compiled_variants as cv
    if cv.available():
        pytest.skip(cv.available())
    calls, dims = cv.compile_keys("dit3_xl_2", sizes=(64,), batches=(1, 2), dtypes=(torch.float32,))
    counts = {k[0]: n for k, n in cv.variants_per_kernel(calls, dims).items()}
    assert dims == "72" and {"vit3_ttt._taps", "vit3_ttt._dwconv", "vit3_ttt._swiglu_vjp"} <= set(counts)
    assert all(n == 1 for n in counts.values()), counts


def test_fused_kernels_compile_once_per_dtype_and_head_dim(tmp_path):
    """Over the standard shapes (ViT3-T/S/B, H-ViT3-T's stages; 224 to 1024 px; batch 1 to 64) every fused kernel
    has one compiled variant per dtype and head dim: the per-image sizes are not specialised
    (experiments/compiled_variants.py, Triton's own cache key, no GPU)."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "variants.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(root / "experiments" / "compiled_variants.py"), "--out", str(out)],
                   check=True, env=env, cwd=root, capture_output=True, timeout=600)
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| vit3_ttt._")]
    assert len(rows) == 6 * 3 * 2  # six kernels, three dtypes, head dims 32 and 64
    assert all(int(r[-1]) == 1 for r in rows), [r for r in rows if int(r[-1]) != 1]


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
def test_fused_qkv_ops_fakes_match(triton):
    # the fakes of ttt_zoo::vit3_qkv_fwd / _bwd give the real outputs' shapes, dtypes and strides, on both paths
    if triton and not TRITON_OK:
        pytest.skip("the Triton kernels cannot run here")
    b, heads, d, h, w = 2, 2, 16, 3, 4
    c = heads * d
    qkv = torch.randn(b, h * w, 3 * c + 3 * d, device=DEV)
    ws = [torch.randn(b, heads, d, d, device=DEV) * 0.05 for _ in range(2)] + [torch.randn(d, 1, 3, 3, device=DEV)]
    cos, sin = (t.to(DEV) for t in rope_2d_tables((h, w), c))
    args = [*_six_views(qkv, heads, d, h, w), *ws, 0.5, True, cos, sin, triton]
    torch.library.opcheck(torch.ops.ttt_zoo.vit3_qkv_fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    out, *small = torch.ops.ttt_zoo.vit3_qkv_fwd(*args)
    torch.library.opcheck(torch.ops.ttt_zoo.vit3_qkv_bwd.default, [torch.randn_like(out)] + args[:9] + small + args[9:],
                          test_utils=("test_schema", "test_faketensor"))


def _count_triton_launches(monkeypatch):
    """Count every Triton kernel launch (compiled or interpreted) by wrapping the JIT functions' ``run``; the
    interpreter's own aten ops inside a launch are hidden from dispatch modes (a GPU runs none)."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime import interpreter, jit
    calls = []

    def wrap(run):
        def counted(self, *a, **k):
            calls.append(self.fn.__name__)
            with _disable_current_modes():
                return run(self, *a, **k)
        return counted

    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        monkeypatch.setattr(cls, "run", wrap(cls.run))
    return calls


class _AtenLaunches(torch.utils._python_dispatch.TorchDispatchMode):
    """aten ops that would launch a kernel: every op but views and allocations without a fill."""
    FREE = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "_unsafe_view")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, ret = func.overloadpacket.__name__, func._schema.returns
        view = bool(ret) and ret[0].alias_info is not None and not ret[0].alias_info.is_write
        if name not in self.FREE and not view:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@triton_test
@pytest.mark.parametrize("rope", [False, True])
def test_fused_qkv_op_launches_three_kernels_each_way(monkeypatch, rope):
    """The fused op's forward and backward launch at most 3 Triton kernels each and no aten kernel (only
    torch.empty buffers and views of them), H-ViT3's RoPE (and its inverse on dq, dk) included."""
    b, heads, d, h, w = 2, 2, 32, 5, 7
    c = heads * d
    qkv = torch.randn(b, h * w, 3 * c + 3 * d, device=DEV)
    ws = [torch.randn(1, heads, d, d, device=DEV) * 0.05 for _ in range(2)] + [torch.randn(d, 1, 3, 3, device=DEV)]
    views = _six_views(qkv, heads, d, h, w)
    tables = [t.to(DEV) for t in rope_2d_tables((h, w), c)] if rope else [None, None]
    launches = _count_triton_launches(monkeypatch)
    with _AtenLaunches() as aten:
        out, *small = FUSED.qkv_fused_fwd(*views, *ws, 1 / 3, True, *tables)
    assert launches == ["_fwd_update", "_fwd_finalize", "_fwd_apply"] and aten.ops == [], (launches, aten.ops)
    launches.clear()
    dout = torch.randn_like(out)
    with _AtenLaunches() as aten:
        FUSED.qkv_fused_bwd(dout, *views, *ws, *small, 1 / 3, True, *tables)
    assert launches == ["_bwd_apply", "_bwd_finalize", "_bwd_update"] and aten.ops == [], (launches, aten.ops)


@triton_test
def test_bad_shapes_raise():
    q = torch.randn(1, 2, 8, 16, device=DEV)
    with pytest.raises(ValueError, match="w1 must be"):
        T.swiglu_fwd_triton(q, q, q, torch.randn(1, 2, 8, 8, device=DEV), torch.randn(1, 2, 8, 8, device=DEV), 1.0)
    m = torch.randn(1, 4, 3, 3, device=DEV)
    with pytest.raises(ValueError, match="w3 must be"):
        T.dwconv_fwd_triton(m, m, m, torch.randn(5, 1, 3, 3, device=DEV), 1.0)


# ------------------------------------------------------------ float64 gradcheck of every custom op / Function
@pytest.mark.parametrize("rope", [False, True])
def test_qkv_custom_op_gradcheck(rope):
    # QKVTTTOps: the mixer core over the ttt_zoo::vit3_* custom ops (their float64 kernels run PyTorch)
    heads, h, w = 2, 2, 3
    args, cos, sin = _qkv_leaves(h, w, rope, heads=heads)
    f = lambda *a: qkv_ttt_op(*a, (h, w), heads, 0.7, True, cos, sin)  # noqa: E731
    assert torch.autograd.gradcheck(f, args, fast_mode=True)


@pytest.mark.parametrize("normalize", [True, False])
def test_custom_ops_gradcheck_per_sample_and_unnormalised(normalize):
    inputs = _leaves((2, 1, 5, 3), (2, 1, 5, 3), (2, 1, 5, 3)) + _leaves((2, 1, 3, 3), (2, 1, 3, 3), scale=0.3)
    assert torch.autograd.gradcheck(lambda *a: ops.swiglu_ttt_op(*a, 0.7, normalize), inputs, fast_mode=True)
    inputs = _leaves((2, 2, 3, 4), (2, 2, 3, 4), (2, 2, 3, 4), (2, 1, 3, 3))
    assert torch.autograd.gradcheck(lambda *a: ops.dwconv_ttt_op(*a, 0.7, normalize), inputs, fast_mode=True)


# ------------------------------------------------------------------------------------------- empty batch
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    # conv2d refuses groups=0: an empty batch must still give an empty output (and an empty gradient)
    m = ViT3TTT(32, num_heads=2, backend=backend, rope=True)
    x = torch.randn(0, 12, 32, requires_grad=True)
    out = m(x, (3, 4))
    assert out.shape == (0, 12, 32)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(m.w3.grad, torch.zeros_like(m.w3))
    q = torch.randn(0, 8, 3, 5)
    assert dwconv_ttt(q, q, q, torch.randn(8, 1, 3, 3), 1 / 3, backend=backend).shape == q.shape
    assert torch.jit.script(m)(x.detach(), (3, 4)).shape == (0, 12, 32)  # the TorchScript form
