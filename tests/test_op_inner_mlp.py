"""The T5 / T5+ / DiT5 inner-step ops (``kernels/inner_mlp``: T5's 3-matrix SwiGLU, DiT5's 2-layer SiLU MLP): every
path against the reference.

The references against autograd of the stated inner loss (independent of the closed-form gradients); torch (the
recomputing backward) against the references in float64 and gradcheck; the Triton kernels (under
TRITON_INTERPRET=1 without a GPU) forward and every input/weight gradient, tight in float32, looser in float16, with
small tiles so tiny shapes span several programs and partial tiles (N % BLOCK_N != 0, head dims 32/64/72, batch 1
and 3, shared and per-sample weights, a mixer on a non-square map); the backend decision, the ttt_zoo::t5_* /
dit5_* custom ops (gradcheck, opcheck), torch.compile, meta-device tensors and an empty batch.
"""
import pytest
import torch
import torch.nn.functional as F

from _ops import BACKENDS, DEV, META_BACKENDS, compare_kernel, triton_kernels, triton_test
from ttt_zoo.kernels import get_op, key_instance_norm, mlp_ttt, t5_swiglu_ttt
from ttt_zoo.kernels.backend import MAX_HEAD_DIM, BackendError, resolve_backend
from ttt_zoo.kernels.inner_mlp.naive import mlp_ttt_reference, t5_swiglu_ttt_reference
from ttt_zoo.kernels.inner_mlp.ops import mlp_ttt_op, t5_swiglu_ttt_op
from ttt_zoo.kernels.inner_mlp.torch import mlp_ttt_torch, t5_swiglu_ttt_torch
from ttt_zoo.kernels.key_norm import key_norm_op, key_norm_reference, key_norm_torch
from ttt_zoo.layers.dit5_mixer import DiT5MixedAttention
from ttt_zoo.layers.t5_ttt import T5TTT, stacked_heads

T = triton_kernels("inner_mlp")
KT = triton_kernels("key_norm")


def _compare_k(f_new, f_ref, inputs, dtype, names):
    compare_kernel(f_new, f_ref, inputs, dtype, names, KTOL)


OPS = {  # name: (recomputing torch path, custom op entry, reference, number of inner weights)
    "t5": (t5_swiglu_ttt_torch, t5_swiglu_ttt_op, t5_swiglu_ttt_reference, 3),
    "dit5": (mlp_ttt_torch, mlp_ttt_op, mlp_ttt_reference, 2),
}


def _inputs(b, h, n, d, wb, n_w, dtype=torch.float64, std=0.3):
    x = [torch.randn(b, h, n, d, dtype=dtype) for _ in range(3)]
    x += [torch.randn(wb, h, d, d, dtype=dtype) * std for _ in range(n_w)]
    return [t.requires_grad_() for t in x]


def _fwd_bwd(f, x, do):
    out = f(*x)
    return [out] + list(torch.autograd.grad(out, x, do))


@pytest.mark.parametrize("shared", [True, False], ids=["shared_w", "per_sample_w"])
@pytest.mark.parametrize("op", ["t5", "dit5"])
def test_recompute_matches_reference_fp64(op, shared):
    fast, _, ref, n_w = OPS[op]
    b, h, n, d = 3, 2, 11, 6
    x = _inputs(b, h, n, d, 1 if shared else b, n_w, std=0.5)
    do = torch.randn(b, h, n, d, dtype=torch.float64)
    got = _fwd_bwd(lambda *a: fast(*a, 0.4), x, do)
    want = _fwd_bwd(lambda *a: ref(*a, 0.4), x, do)
    names = ["out", "dq", "dk", "dv"] + [f"dw{i + 1}" for i in range(n_w)]
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"{op} {name}: {m}")
    assert got[-1].abs().max() > 1e-3  # the gradients are not trivially zero


@pytest.mark.parametrize("op", ["t5", "dit5"])
def test_mix_blend_every_path_fp64(op):
    # the T5+ / DiT5 blend inside the op: (1 - a) TTT + a mix.  The reference against the plain op plus the blend
    # written out; the recomputing path, the custom op (PyTorch path) and gradcheck against the reference, d mix too
    fast, custom, ref, n_w = OPS[op]
    b, h, n, d, a = 2, 2, 9, 5, 0.3
    x = _inputs(b, h, n, d, 1, n_w, std=0.5)
    mix = torch.randn(b, n, h, d, dtype=torch.float64).transpose(1, 2).requires_grad_()  # NA's layout
    plain = ref(*[t.detach() for t in x], 0.4)
    torch.testing.assert_close(ref(*[t.detach() for t in x], 0.4, mix=mix.detach(), mix_weight=a),
                               (1 - a) * plain + a * mix.detach(), rtol=1e-13, atol=1e-13)
    do = torch.randn(b, h, n, d, dtype=torch.float64)
    want = _fwd_bwd(lambda *t: ref(*t[:-1], 0.4, mix=t[-1], mix_weight=a), x + [mix], do)
    for f in (fast, lambda *t, **kw: custom(*t, triton=False, **kw)):
        got = _fwd_bwd(lambda *t: f(*t[:-1], 0.4, mix=t[-1], mix_weight=a), x + [mix], do)
        for name, g, w in zip(["out", "dq", "dk", "dv"] + [f"dw{i + 1}" for i in range(n_w)] + ["dmix"], got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"{op} {name}: {m}")
    torch.testing.assert_close(want[-1], a * do, rtol=0, atol=0)
    small = _inputs(1, 1, 4, 3, 1, n_w, std=0.5)
    small_mix = torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: custom(*t[:-1], 0.7, triton=False, mix=t[-1], mix_weight=a),
                                    small + [small_mix], fast_mode=True)
    with pytest.raises(ValueError, match="mix must match"):
        custom(*[t.detach() for t in x], 0.4, mix=mix.detach()[:, :, :3], mix_weight=a)


@pytest.mark.parametrize("op", ["t5", "dit5"])
def test_recompute_and_custom_op_gradcheck(op):
    fast, custom, _, n_w = OPS[op]
    x = _inputs(2, 1, 5, 3, 1, n_w, std=0.5)
    assert torch.autograd.gradcheck(lambda *a: fast(*a, 0.7), x)
    assert torch.autograd.gradcheck(lambda *a: custom(*a, 0.7), x, fast_mode=True)


def test_bad_inputs_raise():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="w3 must be"):
        t5_swiglu_ttt_torch(q, q, q, torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), torch.randn(2, 4, 4), 1.0)
    with pytest.raises(ValueError, match="q, k, v must share"):
        mlp_ttt_torch(q, q[:, :, :3], q, torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), 1.0)
    with pytest.raises(ValueError, match=r"\(B, N, C\)"):
        key_norm_torch(torch.randn(4, 5), 1.0)
    with pytest.raises(ValueError, match="eps"):
        key_norm_torch(torch.randn(1, 4, 5), 0.0)


def test_dispatch_backends(monkeypatch):
    dev = torch.device("cpu")
    assert get_op("t5_swiglu_ttt", dev) is t5_swiglu_ttt_torch
    assert get_op("dit5_mlp_ttt", dev) is mlp_ttt_torch
    assert get_op("key_instance_norm", dev) is key_norm_torch
    assert get_op("t5_swiglu_ttt", dev, "torch_naive") is t5_swiglu_ttt_reference
    monkeypatch.setenv("TTT_ZOO_BACKEND", "torch_naive")
    assert get_op("dit5_mlp_ttt", dev) is mlp_ttt_reference
    assert get_op("key_instance_norm", dev) is key_norm_reference


def test_custom_ops_opcheck():
    q = [torch.randn(2, 2, 7, 8) for _ in range(3)]
    w = [torch.randn(1, 2, 8, 8) * 0.2 for _ in range(3)]
    torch.library.opcheck(torch.ops.ttt_zoo.t5_swiglu_fwd.default, [*q, *w, 0.5, False],
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ttt_zoo.dit5_mlp_fwd.default, [*q, *w[:2], 0.5, False],
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ttt_zoo.key_instance_norm_fwd.default, [torch.randn(2, 9, 6), 1.0, False],
                          test_utils=("test_schema", "test_faketensor"))
    mix = torch.randn(2, 7, 2, 8).transpose(1, 2)
    qk = torch.randn(2, 7, 2, 2, 8).permute(2, 0, 3, 1, 4)  # stacked q, k (k=None): a view of a (B, N, 2C) tensor
    for name, ws in (("t5_swiglu_fwd", w), ("dit5_mlp_fwd", w[:2])):
        torch.library.opcheck(getattr(torch.ops.ttt_zoo, name).default, [*q, *ws, 0.5, False, mix, 0.5],
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(getattr(torch.ops.ttt_zoo, name).default, [qk, None, q[2], *ws, 0.5, False, mix, 0.5],
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.ttt_zoo.qk_norm_fold_fwd.default,
                          [q[0][:, 0], q[1][:, 0], 1.0, torch.randn(8, 1, 3, 3), torch.randn(8),
                           torch.randn(8, 1, 3, 3), torch.randn(8), False, True],
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ttt_zoo.qkv_fold_fwd.default,
                          [torch.randn(2, 6, 24), 1.0, torch.randn(1, 1, 8, 2), torch.randn(1, 1, 8, 2),
                           torch.randn(8, 1, 3, 3), torch.randn(8), torch.randn(8, 1, 3, 3), torch.randn(8), 2, 3, False],
                          test_utils=("test_schema", "test_faketensor"))


def test_stacked_qk_matches_separate_fp64():
    # the ops' stacked form (k=None: q and k as one (2, B, heads, N, d) view, their gradient one tensor) is the
    # separate form: outputs and every gradient, T5 and DiT5, the PyTorch path, in float64
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 9, 2 * 16, generator=gen, dtype=torch.float64)  # (B, N, 2C), C = 2 heads x 8
    v = torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64)
    for op, n_w in ((t5_swiglu_ttt_op, 3), (mlp_ttt_op, 2)):
        ws = [torch.randn(1, 2, 8, 8, generator=gen, dtype=torch.float64) * 0.2 for _ in range(n_w)]
        res = []
        for stacked in (True, False):
            leaves = [base.clone().requires_grad_(), v.clone().requires_grad_()] + \
                     [w.clone().requires_grad_() for w in ws]
            qk = stacked_heads(leaves[0], 2)
            args = (qk, None) if stacked else (qk[0], qk[1])
            out = op(*args, leaves[1], *leaves[2:], 0.3, triton=False)
            res.append([out] + list(torch.autograd.grad(out.sin().sum(), leaves)))
        for a, b in zip(*res):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("which", ["wrapper", "custom_op"])
def test_torch_compile_fullgraph(which):
    torch._dynamo.reset()
    x = _inputs(2, 2, 9, 8, 1, 3, dtype=torch.float32, std=0.2)
    if which == "wrapper":  # the dispatching wrappers (default CPU backend: the recomputing autograd.Function)
        def f(q, k, v, w1, w2, w3):
            kn = key_instance_norm(k.flatten(2), 1.0).view_as(k)
            return t5_swiglu_ttt(q, kn, v, w1, w2, w3, 0.3) + mlp_ttt(q, k, v, w1, w2, 0.3)
    else:  # the custom ops as opaque graph nodes
        def f(q, k, v, w1, w2, w3):
            kn = key_norm_op(k.flatten(2), 1.0).view_as(k)
            return t5_swiglu_ttt_op(q, kn, v, w1, w2, w3, 0.3) + mlp_ttt_op(q, k, v, w1, w2, 0.3)
    do = torch.randn(2, 2, 9, 8)
    got = _fwd_bwd(torch.compile(f, backend="aot_eager", fullgraph=True), x, do)
    want = _fwd_bwd(f, x, do)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", META_BACKENDS)
@pytest.mark.parametrize("mixer", ["t5", "dit5"])
def test_meta_device(mixer, backend):
    with torch.device("meta"):
        if mixer == "t5":
            m = T5TTT(64, num_heads=2, backend=backend)
        else:
            m = DiT5MixedAttention(64, 2, kernel_size=3, backend=backend)
        x = torch.randn(2, 4 * 6, 64, requires_grad=True)
    out = m(x, (4, 6))
    assert out.device.type == "meta" and out.shape == (2, 24, 64)
    out.sum().backward()
    assert x.grad.shape == x.shape and m.w1.grad.shape == m.w1.shape and m.qkv.weight.grad.device.type == "meta"


def test_meta_through_custom_ops():
    q = torch.empty(2, 3, 10, 8, device="meta", dtype=torch.float16)
    w = torch.empty(1, 3, 8, 8, device="meta")
    out, w1n, w2n, w3n = torch.ops.ttt_zoo.t5_swiglu_fwd(q, q, q, w, w, w, 0.5, False)
    assert out.shape == q.shape and out.dtype == torch.float16 and w3n.shape == (2, 3, 8, 8)
    assert w1n.dtype == torch.float32
    grads = torch.ops.ttt_zoo.dit5_mlp_bwd(q, q, q, q, w, w, w1n, w2n, 0.5, False)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape)] * 3 + [(1, 3, 8, 8)] * 2
    y, mean, rstd = torch.ops.ttt_zoo.key_instance_norm_fwd(torch.empty(2, 10, 24, device="meta"), 1.0, False)
    assert y.shape == (2, 10, 24) and mean.shape == rstd.shape == (2, 24)


@pytest.mark.parametrize("mixer", ["t5", "dit5"])
def test_mixer_backends_agree(mixer):
    m = T5TTT(32, num_heads=2) if mixer == "t5" else DiT5MixedAttention(32, 2, kernel_size=3)
    x = torch.randn(2, 3 * 5, 32, requires_grad=True)
    outs, grads = [], []
    for backend in ("torch", "torch_naive"):  # triton: test_mixer_triton_vs_naive_non_square
        m.backend = backend
        out = m(x, (3, 5))
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [x, m.w1, m.w2, m.qkv.weight]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _saved_bytes(fn, module):
    """Bytes of distinct non-parameter tensor storages autograd keeps for the backward of fn()."""
    seen = {}
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_t5_mixer_recompute_same_grads_less_saved():
    torch.manual_seed(0)
    m = T5TTT(64, num_heads=2)
    x = torch.randn(2, 12 * 10, 64, requires_grad=True)
    res = []
    for recompute in (False, True):
        m.recompute = recompute
        out, saved = _saved_bytes(lambda: m(x, (12, 10)), m)
        grads = torch.autograd.grad(out.square().sum(), [x, m.w1, m.qkv.weight, m.k_conv2d.weight])
        res.append((out, grads, saved))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=0, atol=0)
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    n_c = x.numel() * 4  # bytes of one (B, N, C) fp32 activation
    # without: qkv output (3), key-norm output, q2, k2 and the proj input; with: the mixer input and proj input
    assert res[0][2] >= 7 * n_c and res[1][2] <= 2.2 * n_c, (res[0][2] / n_c, res[1][2] / n_c)


# ------------------------------------------------------------ T5 reference vs. autograd of its inner loss
def _f(x, w1, w2, w3):
    return (F.silu(x @ w1) * (x @ w2)) @ w3


def _autograd_step(q, k, v, w1, w2, w3, scale):
    """Per sample: W_i' = W_i - dL/dW_i with L = -(scale/N) sum_n <f(k_n), v_n>, then f_{W'}(q)."""
    outs = []
    n = k.shape[-2]
    for b in range(q.shape[0]):
        ws = [w[0].detach().clone().requires_grad_(True) for w in (w1, w2, w3)]
        loss = -(scale / n) * (_f(k[b], *ws) * v[b]).sum()
        grads = torch.autograd.grad(loss, ws)
        outs.append(_f(q[b], *[w - g for w, g in zip(ws, grads)]))
    return torch.stack(outs)


def _t5_inputs(b=2, heads=2, n=12, d=8, dtype=torch.float64, std=0.5):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, heads, n, d, generator=g, dtype=dtype) for _ in range(3))
    w1, w2, w3 = (torch.randn(1, heads, d, d, generator=g, dtype=dtype) * std for _ in range(3))
    return q, k, v, w1, w2, w3


def test_matches_autograd_of_inner_loss():
    q, k, v, w1, w2, w3 = _t5_inputs()
    scale = 8 ** -0.5
    out = t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, scale)
    ref = _autograd_step(q, k, v, w1, w2, w3, scale)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # the step matters: without it the output differs
    assert not torch.allclose(out, _f(q, w1, w2, w3), atol=1e-3)


def test_samples_do_not_mix():
    q, k, v, w1, w2, w3 = _t5_inputs()
    out = t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, 0.3)
    single = t5_swiglu_ttt_reference(q[1:], k[1:], v[1:], w1, w2, w3, 0.3)
    torch.testing.assert_close(out[1:], single, rtol=1e-13, atol=1e-13)


def test_gradients_flow_through_update():
    q, k, v, w1, w2, w3 = _t5_inputs(b=1, heads=1, n=5, d=3)
    args = [t.requires_grad_(True) for t in (q, k, v, w1, w2, w3)]
    assert torch.autograd.gradcheck(lambda *a: t5_swiglu_ttt_reference(*a, 0.7), args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_fp32(dtype):
    q, k, v, w1, w2, w3 = _t5_inputs(n=64, dtype=torch.float32, std=0.2)
    low = [t.to(dtype) for t in (q, k, v, w1, w2, w3)]
    out = t5_swiglu_ttt_reference(*low, 8 ** -0.5)
    assert out.dtype == dtype
    # identical to running the float32 op on the rounded inputs, then rounding once
    ref32 = t5_swiglu_ttt_reference(*[t.float() for t in low], 8 ** -0.5)
    torch.testing.assert_close(out, ref32.to(dtype), rtol=0, atol=0)


def test_dispatch_registers_reference():
    # the plain reference is the torch_naive backend; the default CPU path (recomputing backward) matches it
    assert get_op("t5_swiglu_ttt", torch.device("cpu"), "torch_naive") is t5_swiglu_ttt_reference
    q, k, v, w1, w2, w3 = _t5_inputs()
    torch.testing.assert_close(t5_swiglu_ttt(q, k, v, w1, w2, w3, 0.5),
                               t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, 0.5), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------ Triton kernels
KTOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=5e-3, rtol=5e-3)}
DEFAULT_TILES = (T.BLOCK_N, T.TILES) if T else None  # before the fixture shrinks them
KERNEL_OPS = {"t5": (T.t5_swiglu_ttt_triton, t5_swiglu_ttt_reference, 3),
              "dit5": (T.mlp_ttt_triton, mlp_ttt_reference, 2)} if T else {}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    if DEV == "cpu" and T is not None:  # the interpreter is slow: shrink tiles so tiny inputs still tile
        monkeypatch.setattr(T, "BLOCK_N", 16)
        monkeypatch.setattr(T, "TILES", 2)
        monkeypatch.setattr(KT, "BLOCK_N", 16)
        monkeypatch.setattr(KT, "BLOCK_C", 16)


OP_NAMES = {"t5": "t5_swiglu_ttt", "dit5": "dit5_mlp_ttt"}
CASES = {  # (B, heads, N, d, per-sample weights), head dims up to each kernel's limit (backend.MAX_HEAD_DIM)
    "t5": [(1, 2, 37, 32, False),   # N not a multiple of the tile, 2 chunks of 2 tiles, shared weights
           (3, 1, 21, 24, True),    # batch 3, per-sample inner weights, head dim 24 (padded to 32)
           (3, 1, 18, 16, False),   # the smallest tile, batch 3 with shared weights
           (2, 1, 40, 64, True)],   # the registered models' head dim, per-sample weights over 2 chunks
    "dit5": [(1, 2, 37, 32, False), (3, 1, 21, 64, True),
             (3, 1, 18, 48, False)],  # head dim 48 (padded to 64)
}


@pytest.mark.parametrize("op,case", [(op, c) for op in CASES for c in CASES[op]],
                         ids=lambda c: c if isinstance(c, str) else "B{}h{}N{}d{}{}".format(*c[:4], "ps" if c[4] else ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_inner_kernels(op, dtype, case):
    assert case[3] <= MAX_HEAD_DIM[OP_NAMES[op]]
    b, h, n, d, per_sample = case
    f, ref, n_w = KERNEL_OPS[op]
    scale = d ** -0.5
    inputs = [torch.randn(b, h, n, d, device=DEV) for _ in range(3)]
    inputs += [torch.randn(b if per_sample else 1, h, d, d, device=DEV) * 0.05 for _ in range(n_w)]
    _compare_k(lambda *a: f(*a, scale), lambda *a: ref(*a, scale), inputs, dtype,
             ["q", "k", "v"] + [f"w{i + 1}" for i in range(n_w)])


@pytest.mark.parametrize("op,n,d", [("t5", 70, 24), ("dit5", 300, 48)], ids=["t5N70d24", "dit5N300d48"])
@triton_test
def test_inner_kernels_default_tiles(op, n, d, monkeypatch):
    # the shipped tile sizes: different token tiles for update / apply / backward, two 256-token chunks at N = 300
    monkeypatch.setattr(T, "BLOCK_N", DEFAULT_TILES[0])
    monkeypatch.setattr(T, "TILES", DEFAULT_TILES[1])
    f, ref, n_w = KERNEL_OPS[op]
    inputs = [torch.randn(1, 1, n, d, device=DEV) for _ in range(3)]
    inputs += [torch.randn(1, 1, d, d, device=DEV) * 0.05 for _ in range(n_w)]
    _compare_k(lambda *a: f(*a, d ** -0.5), lambda *a: ref(*a, d ** -0.5), inputs, torch.float32,
             ["q", "k", "v"] + [f"w{i + 1}" for i in range(n_w)])


LARGE_N_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # of each tensor's largest magnitude


MIX_CASES = [(3136, 1, 1),  # 56 x 56 tokens, 13 chunks (the finalize path)
             (196, 2, 2)]  # 14 x 14 tokens, one chunk per (batch, head), batch 2, two heads


@pytest.mark.parametrize("n,b,h", MIX_CASES, ids=["N3136", "N196b2h2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op", ["t5", "dit5"])
@triton_test
def test_inner_kernels_mix_vs_float64(op, dtype, n, b, h, monkeypatch):
    # the blend (1 - a) TTT + a mix written by the apply kernel (mix in NA's heads-merged layout), dO scaled by
    # 1 - a and d mix = a dO written by the backward apply kernel: forward and every gradient, d mix included,
    # against the float64 reference on the same data, head dim 64, the shipped tiles; still 3 + 3 launches at most
    from ttt_zoo.bench.launches import count_launches
    monkeypatch.setattr(T, "BLOCK_N", DEFAULT_TILES[0])
    monkeypatch.setattr(T, "TILES", DEFAULT_TILES[1])
    _, custom, ref, n_w = OPS[op]
    d, a = 64, 0.3
    gen = torch.Generator().manual_seed(n + b)
    x = [torch.randn(b, h, n, d, generator=gen) for _ in range(3)]
    x += [torch.randn(1, h, d, d, generator=gen) * 0.05 for _ in range(n_w)]
    x += [torch.randn(b, n, h, d, generator=gen).transpose(1, 2)]
    x = [t.to(dtype) for t in x]
    leaves = [t.to(DEV).requires_grad_() for t in x]
    ref_leaves = [t.double().requires_grad_() for t in x]
    scale = d ** -0.5
    out = custom(*leaves[:-1], scale, triton=True, mix=leaves[-1], mix_weight=a)
    want = ref(*ref_leaves[:-1], scale, mix=ref_leaves[-1], mix_weight=a)
    do = torch.randn(want.shape, generator=gen, dtype=torch.float64).to(dtype)
    got = [out] + list(torch.autograd.grad(out, leaves, do.to(DEV)))
    want = [want] + list(torch.autograd.grad(want, ref_leaves, do.double()))
    names = ["out", "q", "k", "v"] + [f"w{i + 1}" for i in range(n_w)] + ["mix"]
    for name, g, w in zip(names, got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        err = (g.cpu().double() - w).abs().max() / w.abs().max()
        assert w.abs().max() > 0 and err < LARGE_N_TOL[dtype], f"{op} N={n} {name}: {err:.2e} of its max"
    if n > 256 or dtype != torch.float32:
        return
    names = ("t5_swiglu_fwd", "t5_swiglu_bwd") if op == "t5" else ("dit5_mlp_fwd", "dit5_mlp_bwd")
    fwd, bwd = (getattr(torch.ops.ttt_zoo, name) for name in names)
    q, k, v, *ws, mix = [t.detach() for t in leaves]
    res = fwd(q, k, v, *ws, scale, True, mix, a)
    for name, call in ((names[0], lambda: fwd(q, k, v, *ws, scale, True, mix, a)),
                       (names[1], lambda: bwd(do, q, k, v, *ws, *res[1:], scale, True, a, True))):
        c = count_launches(call)
        assert c.aten_total == 0 and c.triton_total == 2, (name, dict(c.aten), dict(c.triton))


VS_FLOAT64_CASES = [(3136, 1, False),  # the size TTT is sold for: a 56 x 56 token map, 13 chunks (the finalize
                                       # path); fp16 would flush the inner-loss products to zero here if the
                                       # kernels scaled before reducing (c = scale / N)
                    (196, 2, False),   # 14 x 14 tokens (every T5 model at 224 px): one chunk, batch 2, shared W
                    (256, 2, True),    # exactly one chunk, per-sample weights
                    (257, 1, False)]   # one token over: two chunks


@pytest.mark.parametrize("n,b,per_sample", VS_FLOAT64_CASES, ids=lambda c: None)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op", ["t5", "dit5"])
@triton_test
def test_inner_kernels_vs_float64(op, dtype, n, b, per_sample, monkeypatch):
    # the shipped tiles (256-token chunks) at head dim 64 (at N <= 256 the update / apply programs do the
    # finalize's work: 2 + 2 launches): forward and every input and weight gradient against the float64 reference
    # on the same (rounded) data
    monkeypatch.setattr(T, "BLOCK_N", DEFAULT_TILES[0])
    monkeypatch.setattr(T, "TILES", DEFAULT_TILES[1])
    f, ref, n_w = KERNEL_OPS[op]
    d = 64
    gen = torch.Generator().manual_seed(n)
    x = [torch.randn(b, 1, n, d, generator=gen) for _ in range(3)]
    x += [torch.randn(b if per_sample else 1, 1, d, d, generator=gen) * 0.05 for _ in range(n_w)]
    x = [t.to(dtype) for t in x]
    leaves = [t.to(DEV).requires_grad_() for t in x]
    ref_leaves = [t.double().requires_grad_() for t in x]
    out, want = f(*leaves, d ** -0.5), ref(*ref_leaves, d ** -0.5)
    do = torch.randn(want.shape, generator=gen, dtype=torch.float64).to(dtype)
    got = [out] + list(torch.autograd.grad(out, leaves, do.to(DEV)))
    want = [want] + list(torch.autograd.grad(want, ref_leaves, do.double()))
    for name, g, w in zip(["out", "q", "k", "v"] + [f"w{i + 1}" for i in range(n_w)], got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        err = (g.cpu().double() - w).abs().max() / w.abs().max()
        assert w.abs().max() > 0 and err < LARGE_N_TOL[dtype], f"{op} N={n} {name}: {err:.2e} of its max"


@pytest.mark.parametrize("op", ["t5", "dit5"])
@triton_test
def test_inner_kernels_launches_one_chunk_and_two(op, monkeypatch):
    # the shipped 256-token chunks: 2 + 2 Triton launches at N <= 256 (3 backward deterministic, bitwise equal run
    # to run and equal to the relaxed sums), 3 + 3 at N = 257; never an aten op inside the op
    from ttt_zoo.bench.launches import count_launches
    monkeypatch.setattr(T, "BLOCK_N", DEFAULT_TILES[0])
    monkeypatch.setattr(T, "TILES", DEFAULT_TILES[1])
    n_w = KERNEL_OPS[op][2]
    names = ("t5_swiglu_fwd", "t5_swiglu_bwd") if op == "t5" else ("dit5_mlp_fwd", "dit5_mlp_bwd")
    fwd, bwd = (getattr(torch.ops.ttt_zoo, name) for name in names)
    for n, launches in ((196, 2), (256, 2), (257, 3)):
        q, k, v, do = [torch.randn(2, 1, n, 64, device=DEV) for _ in range(4)]
        ws = [torch.randn(1, 1, 64, 64, device=DEV) * 0.05 for _ in range(n_w)]
        res = fwd(q, k, v, *ws, 0.3, True)
        relaxed = bwd(do, q, k, v, *ws, *res[1:], 0.3, True)
        for name, call in ((names[0], lambda: fwd(q, k, v, *ws, 0.3, True)),
                           (names[1], lambda: bwd(do, q, k, v, *ws, *res[1:], 0.3, True))):
            c = count_launches(call)
            assert c.aten_total == 0 and c.triton_total == launches, (n, name, dict(c.aten), dict(c.triton))
        if n > 256:
            continue
        torch.use_deterministic_algorithms(True)
        try:
            first = bwd(do, q, k, v, *ws, *res[1:], 0.3, True)
            second = bwd(do, q, k, v, *ws, *res[1:], 0.3, True)
            c = count_launches(lambda: bwd(do, q, k, v, *ws, *res[1:], 0.3, True))
        finally:
            torch.use_deterministic_algorithms(False)
        assert c.triton_total == 3 and c.triton["_bwd_reduce"] == 1, dict(c.triton)
        for g1, g2, g0 in zip(first, second, relaxed):
            assert torch.equal(g1, g2)
            torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_sample", [False, True], ids=["shared_w", "per_sample_w"])
@pytest.mark.parametrize("op", ["t5", "dit5"])
@triton_test
def test_inner_kernels_launch_three_and_three(op, per_sample):
    # the op is fused: 3 Triton launches forward and 3 backward, no aten op inside (the partial sums, W' = W - G
    # and the batch sum of dW run in the finalize kernels)
    from ttt_zoo.bench.launches import count_launches
    n_w = KERNEL_OPS[op][2]
    b, h, n, d = 2, 2, 40, 64
    q, k, v, do = [torch.randn(b, h, n, d, device=DEV) for _ in range(4)]
    ws = [torch.randn(b if per_sample else 1, h, d, d, device=DEV) * 0.05 for _ in range(n_w)]
    names = ("t5_swiglu_fwd", "t5_swiglu_bwd") if op == "t5" else ("dit5_mlp_fwd", "dit5_mlp_bwd")
    fwd, bwd = (getattr(torch.ops.ttt_zoo, name) for name in names)
    res = fwd(q, k, v, *ws, 0.3, True)  # warm up (a compile would count)
    bwd(do, q, k, v, *ws, *res[1:], 0.3, True)
    for name, call in ((names[0], lambda: fwd(q, k, v, *ws, 0.3, True)),
                       (names[1], lambda: bwd(do, q, k, v, *ws, *res[1:], 0.3, True))):
        c = count_launches(call)
        assert c.aten_total == 0 and c.triton_total == 3, (name, dict(c.aten), dict(c.triton))
        assert dict(c.by_op) == {name: 3}


@pytest.mark.parametrize("per_sample", [False, True], ids=["shared_w", "per_sample_w"])
@pytest.mark.parametrize("op", ["t5", "dit5"])
@triton_test
def test_inner_kernels_deterministic_switch(op, per_sample):
    # under torch.use_deterministic_algorithms the backward sums dW in a fixed order (a fourth launch instead of
    # relaxed atomic adds): the same gradients, bitwise equal from run to run
    from ttt_zoo.bench.launches import count_launches
    f, _, n_w = KERNEL_OPS[op]
    b, h, n, d = 3, 2, 45, 32
    x = [torch.randn(b, h, n, d, device=DEV) for _ in range(3)]
    x += [torch.randn(b if per_sample else 1, h, d, d, device=DEV) * 0.1 for _ in range(n_w)]
    x = [t.requires_grad_() for t in x]
    do = torch.randn(b, h, n, d, device=DEV)

    def grads():
        return torch.autograd.grad(f(*x, 0.4), x, do)

    relaxed = grads()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = grads(), grads()
        out = f(*x, 0.4)
        c = count_launches(lambda: torch.autograd.grad(out, x, do, retain_graph=True))
    finally:
        torch.use_deterministic_algorithms(False)
    assert c.triton_total == 4 and c.triton["_bwd_reduce"] == 1, dict(c.triton)
    for g1, g2, g0 in zip(first, second, relaxed):
        assert torch.equal(g1, g2)
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["t5", "dit5"])
def test_kernels_refuse_head_dims_above_their_limit(op):
    # above the limit the backward's shared memory does not fit a GPU (H200: OutOfResources): forcing the kernel
    # is refused with the reason, auto runs PyTorch, and the kernel entry point itself refuses to launch
    name, d = OP_NAMES[op], MAX_HEAD_DIM[OP_NAMES[op]] + 8
    with pytest.raises(BackendError, match=f"head dim {d} is above the kernel's limit"):
        get_op(name, torch.device("cuda"), "triton", torch.float16, d)
    assert resolve_backend("auto", torch.device("cuda"), torch.float16, d, name) == "torch"
    if T is not None:
        x = [torch.randn(1, 1, 5, d, device=DEV) for _ in range(3)]
        w = [torch.zeros(1, 1, d, d, device=DEV)] * KERNEL_OPS[op][2]
        with pytest.raises(ValueError, match=f"head dims up to {d - 8}, got {d}"):
            KERNEL_OPS[op][0](*x, *w, 0.1)


@triton_test
def test_inner_kernels_strided_views():
    # the mixers hand the kernels heads views of (B, N, C) tensors: no copy, arbitrary strides
    b, n, heads, d = 2, 19, 2, 32
    qkv = torch.randn(b, n, 3 * heads * d, device=DEV)
    q, k, v = [t.reshape(b, n, heads, d).transpose(1, 2) for t in qkv.chunk(3, dim=-1)]
    assert not q.is_contiguous()
    w = [torch.randn(1, heads, d, d, device=DEV) * 0.05 for _ in range(3)]
    out, *_ = T.t5_fwd_triton(q, k, v, *w, 0.2)
    torch.testing.assert_close(out, t5_swiglu_ttt_reference(q, k, v, *w, 0.2), **KTOL[torch.float32])


@pytest.mark.parametrize("mixer", ["t5", "t5plus", "dit5"])
@triton_test
def test_mixer_triton_vs_naive_non_square(mixer, monkeypatch):
    calls, bwd_calls = [], []
    gated, has_na = mixer != "dit5", mixer != "t5"
    fwd, bwd = T.inner_fwd_triton, T.inner_bwd_triton  # what the custom op looks up per call
    # (gated, NA blended in by the op's apply kernel) of each call; the backward writes dq and dk as one stacked
    # gradient (the fused q / k conv's: no cat)
    monkeypatch.setattr(T, "inner_fwd_triton", lambda *a: calls.append(a[5] == gated and (a[6] is not None) == has_na)
                        or fwd(*a))
    monkeypatch.setattr(T, "inner_bwd_triton", lambda *a: bwd_calls.append(a[-1] is not None) or bwd(*a))
    kcalls = []
    kname = "_dit5_fwd" if mixer == "dit5" else "_knorm_fwd"  # DiT5: the affine, key norm and convs in one launch
    kfwd = getattr(KT, kname)
    monkeypatch.setattr(KT, kname, type("Spy", (), {"__getitem__": lambda s, g: kcalls.append(1) or kfwd[g]})())
    dim, heads, hw = 64, 2, (3, 7)  # d = 32, N = 21 (not a multiple of the tile), H != W
    m = {"t5": lambda: T5TTT(dim, heads), "t5plus": lambda: T5TTT(dim, heads, na_kernel=3),
         "dit5": lambda: DiT5MixedAttention(dim, heads, kernel_size=3)}[mixer]()
    m = m.to(DEV)
    with torch.no_grad():  # larger inner weights than the init, so the inner step visibly matters
        for w in (m.w1, m.w2) + ((m.w3,) if gated else ()):
            w.normal_(0, 0.1)
    x = torch.randn(3, hw[0] * hw[1], dim, device=DEV, requires_grad=True)
    res = []
    for backend in ("triton", "torch_naive"):
        m.backend = backend
        out = m(x, hw)
        params = [x, m.w1, m.w2, m.qkv.weight, m.k_conv2d.weight, m.k_conv2d.bias, m.q_conv2d.weight,
                  m.q_conv2d.bias]
        res.append([out] + list(torch.autograd.grad(out.square().sum(), params)))
    assert calls and all(calls) and kcalls  # the triton backend really ran the kernels (the mixer's form)
    assert bwd_calls and all(bwd_calls)
    for name, a, b in zip(["out", "dx", "dw1", "dw2", "dqkv", "dkconv", "dkbias", "dqconv", "dqbias"], *res):
        scale = b.abs().max()
        torch.testing.assert_close(a / scale, b / scale, atol=1e-4, rtol=1e-4, msg=lambda msg: f"{name}: {msg}")


@triton_test
def test_bad_shapes_raise():
    q = torch.randn(1, 2, 8, 16, device=DEV)
    w = torch.randn(1, 2, 16, 16, device=DEV)
    with pytest.raises(ValueError, match="w2 must be"):
        T.dit5_fwd_triton(q, q, q, w, torch.randn(1, 2, 8, 8, device=DEV), 1.0)


# ------------------------------------------------------------------------------------------- empty batch
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["t5", "dit5"])
def test_empty_batch(op, backend):
    fast, _, ref, n_w = OPS[op]
    x = _inputs(0, 2, 9, 4, 1, n_w, dtype=torch.float32)
    f = t5_swiglu_ttt if op == "t5" else mlp_ttt
    out = f(*x, 0.5, backend=backend)
    assert out.shape == (0, 2, 9, 4)
    grads = torch.autograd.grad(out.sum(), x[3:])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
