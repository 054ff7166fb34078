"""Triton kernels of the T5 / DiT5 inner steps and the key instance-norm vs. the PyTorch references
(under TRITON_INTERPRET=1 without a GPU).

Forward output and every input/weight gradient; tight in float32, looser in float16 (bf16 is not tested: the
interpreter's bf16 arithmetic is wrong; the kernels upcast to fp32 internally).  Small tiles are patched in so
that tiny shapes span several programs, partial tiles and multi-tile chunks; shapes cover N % BLOCK_N != 0,
head dims 32/64/72 (72 padded to 128 and masked), batch 1 and 3, shared (1, heads, d, d) and per-sample weights,
and a mixer-level run on a non-square map (H != W).
"""
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it before triton is imported)",
                allow_module_level=True)

from ttt_zoo.kernels.inner_mlp.naive import mlp_ttt_reference  # noqa: E402
from ttt_zoo.kernels.inner_mlp import triton as T  # noqa: E402
from ttt_zoo.kernels.key_norm import triton as KT  # noqa: E402
from ttt_zoo.kernels.key_norm.naive import key_norm_reference  # noqa: E402
from ttt_zoo.kernels.inner_mlp.naive import t5_swiglu_ttt_reference  # noqa: E402
from ttt_zoo.layers.dit5_mixer import DiT5MixedAttention  # noqa: E402
from ttt_zoo.layers.t5_ttt import T5TTT  # noqa: E402

pytestmark = pytest.mark.triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=5e-3, rtol=5e-3)}
DEFAULT_TILES = (T.BLOCK_N, T.TILES)  # before the fixture shrinks them
OPS = {"t5": (T.t5_swiglu_ttt_triton, t5_swiglu_ttt_reference, 3), "dit5": (T.mlp_ttt_triton, mlp_ttt_reference, 2)}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    if DEV == "cpu":  # the interpreter is slow: shrink tiles so that tiny inputs still exercise the tiling logic
        monkeypatch.setattr(T, "BLOCK_N", 16)
        monkeypatch.setattr(T, "TILES", 2)
        monkeypatch.setattr(KT, "BLOCK_N", 16)
        monkeypatch.setattr(KT, "BLOCK_C", 16)


def _compare(f_new, f_ref, inputs, dtype, names):
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
    for name, g, r in zip(names, grads, ref_grads):
        assert g.dtype == dtype and g.shape == r.shape, name
        scale = r.abs().max().clamp_min(1e-6)  # compare relative to the gradient's magnitude
        torch.testing.assert_close(g.float() / scale, r / scale, **TOL[dtype], msg=lambda m: f"d{name}: {m}")


CASES = [  # (B, heads, N, d, per-sample weights)
    (1, 2, 37, 32, False),   # N not a multiple of the tile, 2 chunks of 2 tiles, shared weights
    (3, 1, 21, 64, True),    # batch 3, per-sample inner weights
    (3, 1, 18, 72, False),   # head dim 72 (padded to 128), batch 3 with shared weights
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}h{}N{}d{}{}".format(*c[:4], "ps" if c[4] else ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op", ["t5", "dit5"])
def test_inner_kernels(op, dtype, case):
    b, h, n, d, per_sample = case
    f, ref, n_w = OPS[op]
    scale = d ** -0.5
    inputs = [torch.randn(b, h, n, d, device=DEV) for _ in range(3)]
    inputs += [torch.randn(b if per_sample else 1, h, d, d, device=DEV) * 0.05 for _ in range(n_w)]
    _compare(lambda *a: f(*a, scale), lambda *a: ref(*a, scale), inputs, dtype,
             ["q", "k", "v"] + [f"w{i + 1}" for i in range(n_w)])


@pytest.mark.parametrize("op,n,d", [("t5", 70, 72), ("dit5", 300, 32)], ids=["t5N70d72", "dit5N300d32"])
def test_inner_kernels_default_tiles(op, n, d, monkeypatch):
    # the shipped tile sizes: different token tiles for update / apply / backward, two 256-token chunks at N = 300
    monkeypatch.setattr(T, "BLOCK_N", DEFAULT_TILES[0])
    monkeypatch.setattr(T, "TILES", DEFAULT_TILES[1])
    f, ref, n_w = OPS[op]
    inputs = [torch.randn(1, 1, n, d, device=DEV) for _ in range(3)]
    inputs += [torch.randn(1, 1, d, d, device=DEV) * 0.05 for _ in range(n_w)]
    _compare(lambda *a: f(*a, d ** -0.5), lambda *a: ref(*a, d ** -0.5), inputs, torch.float32,
             ["q", "k", "v"] + [f"w{i + 1}" for i in range(n_w)])


def test_inner_kernels_strided_views():
    # the mixers hand the kernels heads views of (B, N, C) tensors: no copy, arbitrary strides
    b, n, heads, d = 2, 19, 2, 32
    qkv = torch.randn(b, n, 3 * heads * d, device=DEV)
    q, k, v = [t.reshape(b, n, heads, d).transpose(1, 2) for t in qkv.chunk(3, dim=-1)]
    assert not q.is_contiguous()
    w = [torch.randn(1, heads, d, d, device=DEV) * 0.05 for _ in range(3)]
    out, *_ = T.t5_fwd_triton(q, k, v, *w, 0.2)
    torch.testing.assert_close(out, t5_swiglu_ttt_reference(q, k, v, *w, 0.2), **TOL[torch.float32])


@pytest.mark.parametrize("shape", [(1, 37, 40), (3, 20, 16)], ids=["B1N37C40", "B3N20C16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_key_norm_kernels(shape, dtype):
    b, n, c = shape
    base = torch.randn(b, n, 3 * c, device=DEV) * 2 + 3
    x = base[..., c:2 * c]  # the k slice of a qkv output
    _compare(lambda t: KT.key_norm_triton(t, 0.5), lambda t: key_norm_reference(t, 0.5), [x], dtype, ["x"])


@pytest.mark.parametrize("mixer", ["t5", "dit5"])
def test_mixer_triton_vs_naive_non_square(mixer, monkeypatch):
    calls = []
    fwd = T.inner_fwd_triton
    monkeypatch.setattr(T, "inner_fwd_triton", lambda *a: calls.append(1) or fwd(*a))
    kcalls = []
    kfwd = KT._knorm_fwd
    monkeypatch.setattr(KT, "_knorm_fwd", type("Spy", (), {"__getitem__": lambda s, g: kcalls.append(1) or kfwd[g]})())
    dim, heads, hw = 64, 2, (3, 7)  # d = 32, N = 21 (not a multiple of the tile), H != W
    m = T5TTT(dim, heads) if mixer == "t5" else DiT5MixedAttention(dim, heads, kernel_size=3)
    m = m.to(DEV)
    with torch.no_grad():  # larger inner weights than the init, so the inner step visibly matters
        for w in (m.w1, m.w2) + ((m.w3,) if mixer == "t5" else ()):
            w.normal_(0, 0.1)
    x = torch.randn(3, hw[0] * hw[1], dim, device=DEV, requires_grad=True)
    res = []
    for backend in ("triton", "torch_naive"):
        m.backend = backend
        out = m(x, hw)
        params = [x, m.w1, m.w2, m.qkv.weight, m.k_conv2d.weight]
        res.append([out] + list(torch.autograd.grad(out.square().sum(), params)))
    assert calls and kcalls  # the triton backend really ran the kernels
    for name, a, b in zip(["out", "dx", "dw1", "dw2", "dqkv", "dkconv"], *res):
        scale = b.abs().max()
        torch.testing.assert_close(a / scale, b / scale, atol=1e-4, rtol=1e-4, msg=lambda msg: f"{name}: {msg}")


def test_bad_shapes_raise():
    q = torch.randn(1, 2, 8, 16, device=DEV)
    w = torch.randn(1, 2, 16, 16, device=DEV)
    with pytest.raises(ValueError, match="w2 must be"):
        T.dit5_fwd_triton(q, q, q, w, torch.randn(1, 2, 8, 8, device=DEV), 1.0)
    with pytest.raises(ValueError, match=r"\(B, N, C\)"):
        KT.key_norm_fwd_triton(q, 1.0)
