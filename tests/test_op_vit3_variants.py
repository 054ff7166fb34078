"""The ViT3 variant op (``kernels/vit3_variant``, op ``vit3_variant_qkv_ttt``): fast paths against the reference.

The lean PyTorch path (analytic recomputing backward) under float64 gradcheck and against the naive reference
(``torch_naive``) for every branch kind (full SwiGLU, last layer, linear), with gradient ascent, Q := K, RoPE, k
steps and without normalisation; the Triton kernels (TRITON_INTERPRET=1 without a GPU) in fp32 and fp16, forward and
every gradient, with small tiles so tiny inputs span several programs and partial tiles; the dispatch; and that the
fast paths really do less work (matmul FLOPs counted by torch's FlopCounterMode).
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from _ops import DEV, compare_kernel, triton_kernels, triton_test
from ttt_zoo.kernels import get_op, vit3_variant_qkv_ttt
from ttt_zoo.kernels.vit3_variant import variant_qkv_naive, variant_qkv_torch
from ttt_zoo.layers import ViT3TTT
from ttt_zoo.layers.rope import rope_2d_tables

T = triton_kernels("vit3_variant")

# (kind, options): kind picks the branch ("all", "last", "linear")
CASES = {
    "v1": ("last", dict(last_only=True)),
    "v3": ("linear", dict(last_only=True)),
    "v6": ("linear", dict(last_only=True, normalize_grad=False)),
    "ascent": ("all", dict(lr=-1.0)),
    "v1_ascent_qk": ("last", dict(last_only=True, lr=-1.0, share_qk=True)),
    "v3_steps3_qk": ("linear", dict(share_qk=True, steps=3)),
    "v1_steps2_unnormalised": ("last", dict(last_only=True, steps=2, normalize_grad=False)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _inputs(kind, b=2, heads=2, d=4, h=3, w=4, share_qk=False, dtype=torch.float64, device="cpu", scale=1.0):
    c = heads * d
    rows = (2 if share_qk else 3) * (c + d)
    g = lambda *s, sc=1.0: (torch.randn(*s, dtype=dtype, device=device) * sc * scale)  # noqa: E731
    return [g(b, h * w, c), g(rows, c, sc=0.5), g(rows, sc=0.5), g(1, heads, d, d, sc=0.3),
            None if kind == "linear" else g(1, heads, d, d, sc=0.3), g(d, 1, 3, 3, sc=0.3)]


def _f(impl, h, w, heads, opts, rope, device="cpu"):
    """The op as a function of its tensors, with the case's options (and RoPE tables for the input's dtype)."""

    def f(x, wt, bias, w1, w2, w3):
        cos, sin = (None, None)
        if rope:
            cos, sin = [t.to(device=device, dtype=x.dtype) for t in rope_2d_tables((h, w), x.shape[-1])]
        normalize = opts.get("normalize_grad", True)
        kw = {k: v for k, v in opts.items() if k != "normalize_grad"}
        return impl(x, wt, bias, w1, w2, w3, (h, w), heads, 0.7, normalize, cos, sin, **kw)
    return f


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_path_gradcheck_and_matches_naive(case, rope):
    kind, opts = CASES[case]
    inputs = [t.requires_grad_() if t is not None else None for t in _inputs(kind, share_qk=opts.get("share_qk", False))]
    leaves = [t for t in inputs if t is not None]
    f = _f(variant_qkv_torch, 3, 4, 2, opts, rope)
    fr = _f(variant_qkv_naive, 3, 4, 2, opts, rope)

    def packed(*ls):  # gradcheck wants tensors only: re-insert the missing w2 of the linear kind
        it = iter(ls)
        return f(*[next(it) if t is not None else None for t in inputs])
    assert torch.autograd.gradcheck(packed, leaves, fast_mode=True)
    out, ref = f(*inputs), fr(*inputs)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, do), torch.autograd.grad(ref, leaves, do)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_full_swiglu_steps_go_to_the_reference():
    inputs = _inputs("all")
    f = _f(variant_qkv_torch, 3, 4, 2, dict(steps=3), False)
    torch.testing.assert_close(f(*inputs), _f(variant_qkv_naive, 3, 4, 2, dict(steps=3), False)(*inputs))
    with pytest.raises(ValueError, match="lr = \\+1"):
        _f(variant_qkv_torch, 3, 4, 2, dict(lr=2.0), False)(*inputs)


def test_dispatch():
    dev = torch.device("cpu")
    assert get_op("vit3_variant_qkv_ttt", dev) is variant_qkv_torch
    assert get_op("vit3_variant_qkv_ttt", dev, "torch_naive") is variant_qkv_naive
    x, wt, bias, w1, w2, w3 = _inputs("last", dtype=torch.float32)
    for backend in ("torch", "torch_naive"):
        out = vit3_variant_qkv_ttt(x, wt, bias, w1, w2, w3, (3, 4), 2, 0.5, True, None, None, True,
                                   backend=backend)
        torch.testing.assert_close(out, variant_qkv_naive(x, wt, bias, w1, w2, w3, (3, 4), 2, 0.5, True, None, None,
                                                          True), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------- the savings are real
def _flops(m: ViT3TTT, x: torch.Tensor, backward: bool) -> int:
    with FlopCounterMode(display=False) as fc:
        out = m(x, (14, 14))
        if backward:
            out.sum().backward()
    return fc.get_total_flops()


@pytest.mark.parametrize("backward", [False, True])
def test_fast_paths_do_fewer_flops(backward):
    x = torch.randn(2, 14 * 14, 192, requires_grad=backward)
    flops = {}
    for name, kw in {"base": {}, "v1": dict(inner_update="last"), "v3": dict(inner_update="last", inner_model="linear"),
                     "qk": dict(share_qk=True)}.items():
        torch.manual_seed(0)
        flops[name] = _flops(ViT3TTT(192, num_heads=6, backend="torch", **kw), x, backward)
    assert flops["base"] > flops["v1"] > flops["v3"], flops
    assert flops["qk"] < flops["base"], flops
    # the projections: 3C + 3d -> 2C + 2d outputs; with d = 32, C = 192 the qkv GEMM is 2/3 of the baseline's
    n = 2 * 196
    qkv_base, qkv_qk = 2 * n * 192 * 3 * 224, 2 * n * 192 * 2 * 224
    assert flops["base"] - flops["qk"] >= (qkv_base - qkv_qk) * (1 if not backward else 2)


# ------------------------------------------------------------------------------------------- Triton kernels
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    if DEV == "cpu" and T is not None:  # the interpreter is slow: small tiles, so tiny inputs still span programs
        monkeypatch.setattr(T, "BLOCK_N", 16)
        monkeypatch.setattr(T, "TILES", 2)
        monkeypatch.setattr(T.F, "launch_cfg", lambda bd, *a, **k: (16, 4))
        monkeypatch.setattr(T.F, "TILES", 2)
        monkeypatch.setattr(T.F, "BLOCK_P", 16)
        T3 = triton_kernels("vit3_ttt")
        monkeypatch.setattr(T3, "BLOCK_N", 16)
        monkeypatch.setattr(T3, "TILES", 2)
        monkeypatch.setattr(T3, "BLOCK_P", 32)


@pytest.mark.parametrize("core", ["fused", "per_branch"])
@pytest.mark.parametrize("case", ["v3", "v1_ascent_qk", "ascent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_triton_path(case, dtype, core, monkeypatch):
    kind, opts = CASES[case]
    if dtype == torch.float16 and case != "v3":
        pytest.skip("covered in fp32; keeps the interpreter run short")
    if core == "per_branch":  # the path of head dims above the fused kernels' limit
        monkeypatch.setitem(T.MAX_HEAD_DIM, "vit3_qkv_fused", 8)
    h, w, heads = 5, 7, 2  # 35 tokens: 3 tiles of 16, the last partial
    inputs = _inputs(kind, heads=heads, d=16, h=h, w=w, share_qk=opts.get("share_qk", False), dtype=torch.float32,
                     device=DEV, scale=0.5)
    if core == "fused":  # per-sample inner weights (batch 2): dW summed per sample, not over the batch
        inputs[3:5] = [None if t is None else t.expand(2, -1, -1, -1).clone() for t in inputs[3:5]]
    present = [i for i, t in enumerate(inputs) if t is not None]
    names = [n for i, n in enumerate("x weight bias w1 w2 w3".split()) if i in present]

    def wrap(impl):
        f = _f(impl, h, w, heads, opts, rope=True, device=DEV)

        def g(*ls):
            it = iter(ls)
            return f(*[next(it) if i in present else None for i in range(6)])
        return g
    compare_kernel(wrap(T.variant_qkv_triton), wrap(variant_qkv_naive), [inputs[i] for i in present], dtype, names,
                   TOL)


@triton_test
def test_triton_linear_kernels_alone():
    # the two kernels of Variants 3 / 6 against plain matmuls, shared and per-sample weights, transposed
    q, k = torch.randn(2, 3, 37, 32, device=DEV), torch.randn(2, 3, 37, 32, device=DEV)
    torch.testing.assert_close(T.gram(q, k), q.transpose(-2, -1) @ k, **TOL[torch.float32])
    for wb in (1, 2):
        wm = torch.randn(wb, 3, 32, 32, device=DEV)
        torch.testing.assert_close(T.matmul(q, wm, 0.5), 0.5 * q @ wm, **TOL[torch.float32])
        torch.testing.assert_close(T.matmul(q, wm, trans=True), q @ wm.transpose(-2, -1), **TOL[torch.float32])
    with pytest.raises(ValueError, match="w1 must be"):
        T.linear_fwd_triton(q, k, k, torch.randn(1, 3, 16, 16, device=DEV), None, 1.0, True, 1.0)


# ------------------------------------------- the fused core (3 + 3 launches) at N in the thousands, vs float64
FUSED_CASES = [("v1", torch.float32), ("v3", torch.float16), ("v6", torch.float32), ("ascent", torch.float16),
               ("v1_ascent_qk", torch.float32), ("v3_steps3_qk", torch.float16)]
FUSED_TOL = {torch.float32: 1e-4, torch.float16: 1e-2}  # max error relative to the reference's max


@pytest.mark.parametrize("case,dtype", FUSED_CASES, ids=[f"{c}-{str(t)[6:]}" for c, t in FUSED_CASES])
@triton_test
def test_fused_core_matches_float64_reference_at_thousands_of_tokens(case, dtype, monkeypatch):
    """N = 56 x 56 = 3136 tokens (several chunks and tiles, the last partial), batch 1, one head of d = 16,
    the kernels' own tiles; forward and every gradient against the float64 reference on the same rounded data;
    3 Triton launches forward and 3 backward, nothing else inside the core but the projection (RoPE, with share_qk,
    is turned inside the kernels)."""
    from ttt_zoo.bench.launches import count_launches
    monkeypatch.undo()  # the kernels' own tile sizes
    kind, opts = CASES[case]
    h = w = 56
    heads, d = 1, 16
    share = opts.get("share_qk", False)
    torch.manual_seed(0)
    inputs = [t if t is None else t.to(DEV, dtype) for t in
              _inputs(kind, b=1, heads=heads, d=d, h=h, w=w, share_qk=share, dtype=torch.float32, scale=0.5)]
    leaves = [t.requires_grad_() for t in inputs if t is not None]
    f = _f(T.variant_qkv_triton, h, w, heads, opts, rope=share, device=DEV)
    out = f(*inputs)  # (builds the cached RoPE tables)
    fwd = count_launches(lambda: f(*inputs))
    do = torch.randn(out.shape, device=DEV).to(dtype)
    bwd = count_launches(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
    assert dict(fwd.triton) == {"_fwd_update": 1, "_fwd_finalize": 1, "_fwd_apply": 1}
    assert dict(bwd.triton) == {"_bwd_apply": 1, "_bwd_finalize": 1, "_bwd_update": 1}
    for op in ("mul", "complex", "neg", "clone", "copy_"):  # H-ViT3's RoPE (and its inverse) runs in the kernels
        assert op not in fwd.aten and op not in bwd.aten, (op, dict(fwd.aten), dict(bwd.aten))
    grads = torch.autograd.grad(out, leaves, do)
    ref_in = [None if t is None else t.detach().cpu().double().requires_grad_() for t in inputs]
    ref = _f(variant_qkv_naive, h, w, heads, opts, rope=share)(*ref_in)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_in if t is not None], do.cpu().double())
    names = [n for n, t in zip("out x weight bias w1 w2 w3".split(), [out] + inputs) if t is not None]
    for name, got, want in zip(names, [out, *grads], [ref, *ref_grads]):
        assert got.dtype == dtype, name
        err = float((got.detach().cpu().double() - want.detach()).abs().max() / want.detach().abs().max())
        assert err < FUSED_TOL[dtype], f"{name}: max error {err:.2e} relative to the reference's max"
