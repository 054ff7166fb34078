"""T5 / DiT5 paper variants ("TTT with KV Binding Is Secretly Linear Attention", Tables 1-2, Figure 1) against a
naive float64 inner loop written here: explicit inner loss, torch.autograd.grad, independent of the kernels."""
import pytest
import torch
import torch.nn.functional as F

from ttt_zoo.kernels import last_layer_ttt
from ttt_zoo.layers.dit5_mixer import DiT5MixedAttention
from ttt_zoo.layers.t5_ttt import T5TTT

DT = torch.float64


def _inner_loop(q, k, v, ws, scale, model, update, steps=1, ascent=False):
    """Naive: f(x; ws) per model, loss per model, `steps` steps of lr 1 on the updated weights only."""
    def f(x, w):
        if model == "t5":
            return (F.silu(x @ w[0]) * (x @ w[1])) @ w[2]
        if model == "dit5":
            return F.silu(x @ w[0]) @ w[1]
        return x @ w[0]  # linear (V3)

    n = k.shape[-2]
    ws = [w.expand(q.shape[0], *w.shape[1:]).clone() for w in ws]
    learn = range(len(ws)) if update == "all" else [len(ws) - 1]
    for _ in range(steps):
        ws = [w.detach().requires_grad_(i in learn) for i, w in enumerate(ws)]
        out = f(k, ws)
        if model == "dit5" or model == "linear_mse":
            loss = scale / (2 * n) * (out - v).pow(2).sum()
        else:
            loss = -scale / n * (out * v).sum()
        grads = torch.autograd.grad(loss, [ws[i] for i in learn])
        for i, g in zip(learn, grads):
            ws[i] = ws[i] + g if ascent else ws[i] - g
    return f(q, [w.detach() for w in ws])


def _qkv(b=2, h=3, n=50, d=8):
    return [torch.randn(b, h, n, d, dtype=DT) for _ in range(3)]


def _ws(n_w, h=3, d=8):
    return [torch.randn(1, h, d, d, dtype=DT) * 0.3 for _ in range(n_w)]


def _mixer_inputs(m, x, feat):
    """Capture the (q, k, v) heads the mixer feeds its inner step, and its inner output (before the op blends in
    the neighbourhood attention, T5+ / DiT5)."""
    seen = {}
    orig = m._inner

    def hook(q, k, v, *na):
        seen["qkv"] = (q, k, v)
        seen["out"] = orig(q, k, v)
        return orig(q, k, v, *na)
    m._inner = hook
    m(x, feat)
    del m._inner
    return seen


VARIANTS = [dict(), dict(inner_update="last"), dict(inner_model="linear"), dict(gradient_ascent=True),
            dict(inner_steps=3), dict(inner_update="last", inner_steps=2, gradient_ascent=True),
            dict(share_qk=True)]


@pytest.mark.parametrize("cls", [T5TTT, DiT5MixedAttention])
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{a}={b}" for a, b in kw.items()) or "base")
@pytest.mark.parametrize("feat", [(5, 7), (28, 28)])
def test_mixer_variant_vs_naive_inner_loop(cls, kw, feat):
    extra = dict(kernel_size=3) if cls is DiT5MixedAttention else {}
    m = cls(24, num_heads=3, backend="torch", **extra, **kw).to(DT)
    for p in m.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(2, feat[0] * feat[1], 24, dtype=DT)
    seen = _mixer_inputs(m, x, feat)
    q, k, v = seen["qkv"]
    if kw.get("share_qk"):
        assert q is k and m.qkv.out_features == 48 and not hasattr(m, "q_conv2d")
    model = "t5" if cls is T5TTT else "dit5"
    linear = kw.get("inner_model") == "linear"
    ws = [m.w3 if cls is T5TTT else m.w2] if linear else ([m.w1, m.w2, m.w3] if cls is T5TTT else [m.w1, m.w2])
    if linear:
        model = "linear" if cls is T5TTT else "linear_mse"
    ref = _inner_loop(q, k, v, [w.detach() for w in ws], m.scale, model, kw.get("inner_update", "all"),
                      kw.get("inner_steps", 1), kw.get("gradient_ascent", False))
    torch.testing.assert_close(seen["out"], ref, rtol=1e-10, atol=1e-10)
    # the output does depend on the variant: the naive loop with the baseline settings differs
    if kw and not kw.get("share_qk") and not linear:
        base = _inner_loop(q, k, v, [w.detach() for w in ws], m.scale, model, "all")
        assert (base - ref).abs().max() > 1e-6


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("loss", ["dot", "mse"])
@pytest.mark.parametrize("backend", ["torch", "torch_naive"])
def test_last_layer_op_forward_backward(loss, steps, backend):
    q, k, v = _qkv(n=37)
    w = _ws(1)[0].requires_grad_()
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = last_layer_ttt(*ins, w, 0.7, loss, steps, backend=backend)
    ref = _inner_loop(q, k, v, [w.detach()], 0.7, "linear" if loss == "dot" else "linear_mse", "all", steps)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, ins + [w], do)
    g_ref = torch.autograd.grad(last_layer_ttt(*ins, w, 0.7, loss, steps, backend="torch_naive"), ins + [w], do)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(lambda *t: last_layer_ttt(*t, 0.7, loss, steps, backend="torch"),
                                    [t[:1, :1, :6, :3].clone().requires_grad_() for t in (q, k, v)]
                                    + [w[:, :1, :3, :3].detach().clone().requires_grad_()])


def test_last_layer_op_has_no_triton_kernel():
    from ttt_zoo.kernels import BackendError
    q, k, v = _qkv()
    with pytest.raises(BackendError, match="no Triton kernel"):
        last_layer_ttt(q.float(), k.float(), v.float(), _ws(1)[0].float(), 0.5, backend="triton")


@pytest.mark.parametrize("kw", [dict(), dict(inner_update="last"), dict(inner_model="linear")])
def test_t5_ascent_equals_descent_with_v_negated(kw):
    """Exact for T5's dot-product loss (the gradient is linear in v) in every variant."""
    torch.manual_seed(1)
    a = T5TTT(24, 3, backend="torch", gradient_ascent=True, **kw).to(DT)
    d = T5TTT(24, 3, backend="torch", **kw).to(DT)
    d.load_state_dict(a.state_dict())
    q, k, v = _qkv(n=40, d=8)
    for p in a.parameters():
        p.data.normal_(0, 0.3)
    d.load_state_dict(a.state_dict())
    torch.testing.assert_close(a._inner(q, k, v), d._inner(q, k, -v), rtol=1e-12, atol=1e-12)
    assert (a._inner(q, k, v) - d._inner(q, k, v)).abs().max() > 1e-3


def test_dit5_ascent_equals_descent_with_reflected_target():
    """DiT5's regression loss: ascent == descent with v replaced by 2 f0(k) - v (not by -v)."""
    a = DiT5MixedAttention(24, 3, kernel_size=3, backend="torch", gradient_ascent=True).to(DT)
    d = DiT5MixedAttention(24, 3, kernel_size=3, backend="torch").to(DT)
    for p in a.parameters():
        p.data.normal_(0, 0.3)
    d.load_state_dict(a.state_dict())
    q, k, v = _qkv(n=40, d=8)
    f0 = F.silu(k @ a.w1) @ a.w2
    torch.testing.assert_close(a._inner(q, k, v), d._inner(q, k, 2 * f0 - v), rtol=1e-12, atol=1e-12)
    assert (a._inner(q, k, v) - d._inner(q, k, -v)).abs().max() > 1e-3


@pytest.mark.parametrize("kw", [dict(inner_update="last"), dict(inner_model="linear")])
def test_t5_k_steps_of_v1_equal_one_step_with_k_times_the_update(kw):
    """Holds when only the last layer learns and the loss is the dot product: the gradient w.r.t. w3 does not
    depend on w3, so k steps add the same update k times (here: one step with the inner-loss scale times k)."""
    m = T5TTT(24, 3, backend="torch", inner_steps=5, **kw).to(DT)
    for p in m.parameters():
        p.data.normal_(0, 0.3)
    q, k, v = _qkv(n=40, d=8)
    one = T5TTT(24, 3, backend="torch", **kw).to(DT)
    one.load_state_dict(m.state_dict())
    one.scale = 5 * m.scale
    torch.testing.assert_close(m._inner(q, k, v), one._inner(q, k, v), rtol=1e-12, atol=1e-12)
    # not so for the full SwiGLU update (w1, w2 move, so the features change between steps)
    full = T5TTT(24, 3, backend="torch", inner_steps=5).to(DT)
    for p in full.parameters():
        p.data.normal_(0, 0.3)
    full1 = T5TTT(24, 3, backend="torch").to(DT)
    full1.load_state_dict(full.state_dict())
    full1.scale = 5 * full.scale
    assert (full._inner(q, k, v) - full1._inner(q, k, v)).abs().max() > 1e-6


def test_inner_steps_settable_and_defaults_unchanged():
    m = T5TTT(24, 3, backend="torch").to(DT)
    q, k, v = _qkv(n=20, d=8)
    y1 = m._inner(q, k, v)
    m.inner_steps = 3
    y3 = m._inner(q, k, v)
    ref = _inner_loop(q, k, v, [m.w1.detach(), m.w2.detach(), m.w3.detach()], m.scale, "t5", "all", 3)
    torch.testing.assert_close(y3, ref, rtol=1e-10, atol=1e-10)
    assert (y1 - y3).abs().max() > 0


@pytest.mark.parametrize("cls", [T5TTT, DiT5MixedAttention])
def test_not_applicable_variants_raise(cls):
    with pytest.raises(ValueError, match="normalize_grad=True does not apply"):
        cls(24, 3, normalize_grad=True)
    with pytest.raises(ValueError, match="inner_update must be one of"):
        cls(24, 3, inner_update="first")
    with pytest.raises(ValueError, match="single layer"):
        cls(24, 3, inner_model="linear", inner_update="last")
    with pytest.raises(ValueError, match="inner_steps"):
        cls(24, 3, inner_steps=0)


def test_variants_reach_models_and_script():
    import timm
    x = torch.randn(1, 3, 64, 64)
    m = timm.create_model("t5_tiny", img_size=64, mixer_kwargs=dict(inner_update="last", share_qk=True)).eval()
    assert m.blocks[0].attn.inner_update == "last" and m.blocks[0].attn.qkv.out_features == 2 * 192
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(m)(x), m(x), rtol=1e-5, atol=1e-5)
    d = timm.create_model("dit5_s_2", input_size=16, mixer_kwargs=dict(inner_model="linear"))
    assert not hasattr(d.blocks[0].attn, "w1")
