"""Triton kernels of the ViT3 inner step vs. the PyTorch reference (under TRITON_INTERPRET=1 without a GPU).

Forward output and every input/weight gradient; tight in float32, looser in float16 (bf16 is not tested: the
interpreter's bf16 arithmetic is wrong).  Small tiles are patched in so that tiny shapes still span several programs,
partial tiles and multi-tile chunks; shapes cover N % BLOCK != 0, H != W, head dims 32/64/72 and batch 1/3.
"""
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it before triton is imported)",
                allow_module_level=True)

from ttt_zoo.kernels.vit3_ttt import triton as T  # noqa: E402
from ttt_zoo.kernels.vit3_ttt.torch import qkv_ttt_naive  # noqa: E402
from ttt_zoo.kernels.vit3_ttt.naive import dwconv_ttt_reference, swiglu_ttt_reference  # noqa: E402
from ttt_zoo.layers.rope import rope_2d_tables  # noqa: E402

pytestmark = pytest.mark.triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    if DEV == "cpu":  # the interpreter is slow: shrink tiles so that tiny inputs still exercise the tiling logic
        monkeypatch.setattr(T, "BLOCK_N", 16)
        monkeypatch.setattr(T, "TILES", 2)
        monkeypatch.setattr(T, "BLOCK_P", 32)
        monkeypatch.setattr(T, "MAX_COLS", 32)   # d = 64 and 72 run as several column blocks, d = 32 as one
        monkeypatch.setattr(T, "COL_BLOCK", 16)


def _compare(f_new, f_ref, inputs, dtype):
    """Forward and all gradients; the reference runs in float32 on float32 copies of the same low-precision data."""
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    out = f_new(*leaves)
    ref = f_ref(*ref_leaves)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    for name, g, r in zip("q k v w1 w2 w3".split(), grads, ref_grads):
        assert g.dtype == dtype, name
        scale = r.abs().max().clamp_min(1e-6)  # compare relative to the gradient's magnitude
        torch.testing.assert_close(g.float() / scale, r / scale, **TOL[dtype], msg=lambda m: f"d{name}: {m}")


SWIGLU_CASES = [  # (B, heads, N, d, per-sample weights)
    (1, 2, 37, 32, False),   # N not a multiple of the tile, 3 chunks
    (3, 1, 21, 64, True),    # batch 3, per-sample inner weights
    (1, 1, 18, 72, False),   # head dim 72 (padded to 128)
]


@pytest.mark.parametrize("case", SWIGLU_CASES, ids=lambda c: "B{}h{}N{}d{}{}".format(*c[:4], "ps" if c[4] else ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_swiglu_kernels(case, dtype):
    b, h, n, d, per_sample = case
    if dtype == torch.float16 and d == 72:
        pytest.skip("covered in fp32; keeps the interpreter run short")
    wb = b if per_sample else 1
    inputs = [torch.randn(b, h, n, d, device=DEV) for _ in range(3)]
    inputs += [torch.randn(wb, h, d, d, device=DEV) * 0.05 for _ in range(2)]
    _compare(lambda *a: T.swiglu_ttt_triton(*a, 1 / 3), lambda *a: swiglu_ttt_reference(*a, 1 / 3), inputs, dtype)


def test_swiglu_kernels_no_normalisation():
    inputs = [torch.randn(1, 1, 20, 32, device=DEV) for _ in range(3)]
    inputs += [torch.randn(1, 1, 32, 32, device=DEV) * 0.05 for _ in range(2)]
    _compare(lambda *a: T.swiglu_ttt_triton(*a, 0.5, False), lambda *a: swiglu_ttt_reference(*a, 0.5, False),
             inputs, torch.float32)


@pytest.mark.parametrize("shape", [(1, 32, 7, 5), (3, 4, 9, 12)], ids=["B1d32H7W5", "B3d4H9W12"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dwconv_kernels(shape, dtype):
    b, d, h, w = shape
    inputs = [torch.randn(*shape, device=DEV) for _ in range(3)] + [torch.randn(d, 1, 3, 3, device=DEV) * 0.05]
    _compare(lambda *a: T.dwconv_ttt_triton(*a, 1 / 3), lambda *a: dwconv_ttt_reference(*a, 1 / 3), inputs, dtype)


def test_dwconv_kernels_strided_views():
    # the mixer hands the conv branch transposed views of the qkv output: no copy, arbitrary strides
    b, h, w, d = 2, 5, 6, 8
    qkv = torch.randn(b, h * w, 3 * d + 5, device=DEV)
    q, k, v = [qkv[..., i * d:(i + 1) * d].transpose(1, 2).reshape(b, d, h, w) for i in range(3)]
    assert not q.is_contiguous()
    w3 = torch.randn(d, 1, 3, 3, device=DEV) * 0.05
    out, _ = T.dwconv_fwd_triton(q, k, v, w3, 1 / 3)
    torch.testing.assert_close(out, dwconv_ttt_reference(q, k, v, w3, 1 / 3), **TOL[torch.float32])


def test_qkv_triton_path_with_rope():
    # projection + RoPE + both branches with the Triton inner kernels, vs. the naive composition
    b, heads, d, h, w = 1, 2, 32, 3, 5
    c = heads * d
    cos, sin = [t.to(DEV) for t in rope_2d_tables((h, w), c)]
    inputs = [torch.randn(b, h * w, c, device=DEV), torch.randn(3 * c + 3 * d, c, device=DEV) * 0.1,
              torch.randn(3 * c + 3 * d, device=DEV) * 0.1, torch.randn(1, heads, d, d, device=DEV) * 0.05,
              torch.randn(1, heads, d, d, device=DEV) * 0.05, torch.randn(d, 1, 3, 3, device=DEV) * 0.05]
    _compare(lambda *a: T.qkv_ttt_triton(*a, (h, w), heads, 1 / 3, True, cos, sin),
             lambda *a: qkv_ttt_naive(*a, (h, w), heads, 1 / 3, True, cos, sin), inputs, torch.float32)


def test_bad_shapes_raise():
    q = torch.randn(1, 2, 8, 16, device=DEV)
    with pytest.raises(ValueError, match="w1 must be"):
        T.swiglu_fwd_triton(q, q, q, torch.randn(1, 2, 8, 8, device=DEV), torch.randn(1, 2, 8, 8, device=DEV), 1.0)
    m = torch.randn(1, 4, 3, 3, device=DEV)
    with pytest.raises(ValueError, match="w3 must be"):
        T.dwconv_fwd_triton(m, m, m, torch.randn(5, 1, 3, 3, device=DEV), 1.0)
