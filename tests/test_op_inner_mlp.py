"""T5 / DiT5 inner steps and the key instance-norm: the recomputing PyTorch path (analytic backward) against the
references under autograd (float64 and gradcheck), the dispatch, the ttt_zoo::t5_* / dit5_* / key_instance_norm_*
custom ops (gradcheck, opcheck), torch.compile over the dispatching wrappers and meta-device tensors."""
import pytest
import torch

from ttt_zoo.kernels import get_op, key_instance_norm, mlp_ttt, t5_swiglu_ttt
from ttt_zoo.kernels.inner_mlp.naive import mlp_ttt_reference
from ttt_zoo.kernels.inner_mlp.ops import mlp_ttt_op, t5_swiglu_ttt_op
from ttt_zoo.kernels.inner_mlp.torch import mlp_ttt_torch, t5_swiglu_ttt_torch
from ttt_zoo.kernels.key_norm.ops import key_norm_op
from ttt_zoo.kernels.key_norm import key_norm_reference, key_norm_torch
from ttt_zoo.kernels.inner_mlp.naive import t5_swiglu_ttt_reference
from ttt_zoo.layers.dit5_mixer import DiT5MixedAttention
from ttt_zoo.layers.t5_ttt import T5TTT

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
def test_recompute_and_custom_op_gradcheck(op):
    fast, custom, _, n_w = OPS[op]
    x = _inputs(2, 1, 5, 3, 1, n_w, std=0.5)
    assert torch.autograd.gradcheck(lambda *a: fast(*a, 0.7), x)
    assert torch.autograd.gradcheck(lambda *a: custom(*a, 0.7), x, fast_mode=True)


def test_key_norm_paths_fp64_and_gradcheck():
    base = torch.randn(3, 13, 3 * 5, dtype=torch.float64) * 2 + 1
    x = base[..., 5:10].detach().requires_grad_()  # a strided k slice of a qkv output, as in the mixers
    dy = torch.randn(3, 13, 5, dtype=torch.float64)
    want = _fwd_bwd(lambda t: key_norm_reference(t, 0.5), [x], dy)
    for f in (key_norm_torch, key_norm_op):
        got = _fwd_bwd(lambda t: f(t, 0.5), [x], dy)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        assert torch.autograd.gradcheck(lambda t: f(t, 0.5), [x])
    # the statistics are over the N tokens, per sample and channel
    y = key_norm_torch(x, 1e-12)
    torch.testing.assert_close(y.mean(1), torch.zeros(3, 5, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close(y.var(1, unbiased=False), torch.ones(3, 5, dtype=torch.float64), atol=1e-8, rtol=0)


def test_key_norm_low_precision_stats_in_fp32():
    x = torch.randn(2, 300, 8) * 3 + 100  # large mean: fp16 statistics would cancel
    y = key_norm_torch(x.half(), 1.0)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), key_norm_reference(x.half().float(), 1.0), atol=2e-3, rtol=2e-3)


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
    torch.library.opcheck(torch.ops.ttt_zoo.t5_swiglu_fwd.default, [*q, *w, 0.5],
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ttt_zoo.dit5_mlp_fwd.default, [*q, *w[:2], 0.5],
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ttt_zoo.key_instance_norm_fwd.default, [torch.randn(2, 9, 6), 1.0],
                          test_utils=("test_schema", "test_faketensor"))


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


@pytest.mark.parametrize("backend", ["torch", "triton", "torch_naive"])
@pytest.mark.parametrize("mixer", ["t5", "dit5"])
def test_meta_device(mixer, backend):
    with torch.device("meta"):
        if mixer == "t5":
            m = T5TTT(64, num_heads=2, backend=backend)
        else:
            m = DiT5MixedAttention(64, 2, kernel_size=3, backend=backend)
        x = torch.randn(2, 4 * 6, 64, requires_grad=True)
    if backend == "triton":  # meta tensors go through the custom ops' fake kernels
        m.backend = None
    out = m(x, (4, 6))
    assert out.device.type == "meta" and out.shape == (2, 24, 64)
    out.sum().backward()
    assert x.grad.shape == x.shape and m.w1.grad.shape == m.w1.shape and m.qkv.weight.grad.device.type == "meta"


def test_meta_through_custom_ops():
    q = torch.empty(2, 3, 10, 8, device="meta", dtype=torch.float16)
    w = torch.empty(1, 3, 8, 8, device="meta")
    out, w1n, w2n, w3n = torch.ops.ttt_zoo.t5_swiglu_fwd(q, q, q, w, w, w, 0.5)
    assert out.shape == q.shape and out.dtype == torch.float16 and w3n.shape == (2, 3, 8, 8)
    assert w1n.dtype == torch.float32
    grads = torch.ops.ttt_zoo.dit5_mlp_bwd(q, q, q, q, w, w, w1n, w2n, 0.5)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape)] * 3 + [(1, 3, 8, 8)] * 2
    y, mean, rstd = torch.ops.ttt_zoo.key_instance_norm_fwd(torch.empty(2, 10, 24, device="meta"), 1.0)
    assert y.shape == (2, 10, 24) and mean.shape == rstd.shape == (2, 24)


@pytest.mark.parametrize("mixer", ["t5", "dit5"])
def test_mixer_backends_agree(mixer):
    m = T5TTT(32, num_heads=2) if mixer == "t5" else DiT5MixedAttention(32, 2, kernel_size=3)
    x = torch.randn(2, 3 * 5, 32, requires_grad=True)
    outs, grads = [], []
    for backend in ("torch", "torch_naive"):
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
