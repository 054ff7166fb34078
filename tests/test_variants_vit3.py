"""The ViT3 inner-loop variants of Liu et al., "Test-Time Training with KV Binding Is Secretly Linear Attention"
(Table 1: gradient ascent, Q := K; Table 2: Variants 1, 3, 6; Figure 1: k inner steps) as mixer options.

Every variant of the whole mixer (projection, RoPE, both branches, proj) against an independent float64 reference:
the inner loss written out and differentiated by ``torch.autograd.grad`` (no closed-form gradient, no kernel code),
at a realistic map (56 x 56 tokens) and a small random one, outputs and every gradient; then the exact identities
(ascent == descent with v negated; k steps of a loss linear in the stepped weights == one step of k times the
update) with negative controls where they must fail, Q := K's parameter count and checkpoint filter, the errors,
and the named models.
"""
import pytest
import timm
import torch
import torch.nn.functional as F

import ttt_zoo
from ttt_zoo.checkpoint import CheckpointError, validate_state_dict
from ttt_zoo.layers.mixer import set_inner_steps
from ttt_zoo.layers.rope import apply_rope_2d, rope_2d_tables
from ttt_zoo.layers.vit3_ttt import ViT3TTT, variant_state_dict

BACKENDS = ["torch", "torch_naive"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _col_norm(g, dim):
    return g / (torch.linalg.vector_norm(g, dim=dim, keepdim=True) + 1.0)


def autograd_reference(m: ViT3TTT, x: torch.Tensor, feat_size, lr: float = None) -> torch.Tensor:
    """The mixer from its definition: explicit inner losses, gradients by autograd (create_graph: differentiable).

    ``lr``: the step size (default: -1 for gradient ascent, else 1)."""
    b, n, c = x.shape
    h, w = feat_size
    heads, d = m.num_heads, m.head_dim
    y = x @ m.qkv.weight.t() + (m.qkv.bias if m.qkv.bias is not None else 0)
    if m.share_qk:
        k1, v1, k2, v2 = y.split([c, c, d, d], -1)
        q1, q2 = k1, k2
    else:
        q1, k1, v1, q2, k2, v2 = y.split([c, c, c, d, d, d], -1)
    if m.use_rope:
        cos, sin = [t.to(x.dtype) for t in rope_2d_tables(feat_size, c)]
        q1, k1 = [apply_rope_2d(t.reshape(b, h, w, c), cos, sin).reshape(b, n, c) for t in (q1, k1)]
    q1, k1, v1 = [t.reshape(b, n, heads, d).transpose(1, 2) for t in (q1, k1, v1)]
    q2, k2, v2 = [t.transpose(1, 2).reshape(b, d, h, w) for t in (q2, k2, v2)]
    lr = (-1.0 if m.gradient_ascent else 1.0) if lr is None else lr
    linear, last = m.inner_model == "linear", m.inner_update == "last"

    def f(t, w1, w2):
        return t @ w1 if linear else (t @ w1) * F.silu(t @ w2)

    # SwiGLU / linear branch: per-sample, per-head weights; L = -(s/N) sum_n <f(k_n), v_n>
    w1 = m.w1.expand(b, -1, -1, -1)
    w2 = None if linear else m.w2.expand(b, -1, -1, -1)
    for _ in range(m.inner_steps):
        loss = -(m.scale / n) * (f(k1, w1, w2) * v1).sum()
        stepped = [w1] if (linear or last) else [w1, w2]
        grads = torch.autograd.grad(loss, stepped, create_graph=True)
        if m.normalize_grad:
            grads = [_col_norm(g, -2) for g in grads]
        w1 = w1 - lr * grads[0]
        if len(grads) == 2:
            w2 = w2 - lr * grads[1]
    o1 = f(q1, w1, w2).transpose(1, 2).reshape(b, n, c)

    # conv branch: per-sample 3x3 depthwise kernels; L = -(s/HW) sum conv(k; w3) v
    w3 = m.w3.reshape(1, d, 3, 3).expand(b, -1, -1, -1)

    def conv(t, wt):
        return F.conv2d(t.reshape(1, b * d, h, w), wt.reshape(b * d, 1, 3, 3), padding=1, groups=b * d).reshape(
            b, d, h, w)

    for _ in range(m.inner_steps):
        loss = -(m.scale / (h * w)) * (conv(k2, w3) * v2).sum()
        (g,) = torch.autograd.grad(loss, [w3], create_graph=True)
        w3 = w3 - lr * (_col_norm(g, (-2, -1)) if m.normalize_grad else g)
    o2 = conv(q2, w3).flatten(2).transpose(1, 2)
    return m.proj(torch.cat([o1, o2], -1))


VARIANTS = {
    "v1": dict(inner_update="last"),
    "v3": dict(inner_update="last", inner_model="linear"),
    "v6": dict(inner_update="last", inner_model="linear", normalize_grad=False),
    "ascent": dict(gradient_ascent=True),
    "share_qk": dict(share_qk=True),
    "share_qk_rope": dict(share_qk=True, rope=True),
    "steps3": dict(inner_steps=3),
    "v1_steps3_rope": dict(inner_update="last", inner_steps=3, rope=True),
    "v6_ascent_qk": dict(inner_update="last", inner_model="linear", normalize_grad=False, gradient_ascent=True,
                         share_qk=True),
    "baseline_unnormalised": dict(normalize_grad=False),
}


def _mixer(dim=32, heads=2, seed=0, **kw):
    torch.manual_seed(seed)
    m = ViT3TTT(dim, num_heads=heads, **kw).double()
    with torch.no_grad():  # inner weights large enough that every term (gate, second step) matters
        for p in (m.w1, m.w2, m.w3):
            if p is not None:
                p.normal_(0, 0.3)
        m.qkv.weight.normal_(0, 0.3)
    return m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_autograd_reference_small(name, backend):
    m = _mixer(**VARIANTS[name], backend=backend)
    x = torch.randn(2, 5 * 7, 32, dtype=torch.float64, requires_grad=True)
    out, ref = m(x, (5, 7)), autograd_reference(m, x, (5, 7))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    leaves = [x] + [p for p in m.parameters()]
    do = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, leaves, do), torch.autograd.grad(ref, leaves, do)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", ["v1", "v3", "v6", "share_qk_rope", "v1_steps3_rope"])
def test_variant_matches_autograd_reference_56x56(name):
    # a realistic map (ViT3 at 896 px, or H-ViT3's first stage at 224): 3136 tokens
    m = _mixer(dim=32, heads=2, **VARIANTS[name], backend="torch")
    x = torch.randn(1, 56 * 56, 32, dtype=torch.float64, requires_grad=True)
    out, ref = m(x, (56, 56)), autograd_reference(m, x, (56, 56))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    leaves = [x, m.qkv.weight, m.w1, m.w3] + ([m.w2] if m.w2 is not None else [])
    do = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, leaves, do), torch.autograd.grad(ref, leaves, do)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)


def test_reference_can_fail():
    # negative controls: the reference tells the variants apart (V1 is not the baseline, V6 is not V3)
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    for a, b in (("v1", None), ("v6", "v3"), ("ascent", None)):
        ma = _mixer(**VARIANTS[a])
        mb = _mixer(**(VARIANTS[b] if b else {}))
        if b == "v3":
            mb.load_state_dict(ma.state_dict())
        assert not torch.allclose(autograd_reference(ma, x, (4, 5)), mb(x, (4, 5)), rtol=1e-6, atol=1e-8), (a, b)


# --------------------------------------------------------------------------------------------- exact identities
def _negate_values(m: ViT3TTT) -> ViT3TTT:
    """The same mixer with every value row of qkv negated (v -> -v in both branches)."""
    c, d = m.dim, m.head_dim
    rows = (slice(c, 2 * c), slice(2 * c + d, None)) if m.share_qk else (slice(2 * c, 3 * c), slice(3 * c + 2 * d, None))
    with torch.no_grad():
        for r in rows:
            m.qkv.weight[r] *= -1
            m.qkv.bias[r] *= -1
    return m


@pytest.mark.parametrize("name", ["baseline", "v1", "v3", "v6", "share_qk_rope", "steps3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_ascent_is_descent_with_negated_values(name, backend):
    # g is linear in v and N(-g) = -N(g): w + N(g(v)) = w - N(g(-v)), for any number of steps
    kw = VARIANTS.get(name, {})
    asc = _mixer(**kw, gradient_ascent=True, backend=backend)
    desc = _negate_values(_mixer(**kw, backend=backend))
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    torch.testing.assert_close(asc(x, (4, 5)), desc(x, (4, 5)), rtol=1e-13, atol=1e-14)
    # negative control: without negating v the two differ
    assert not torch.allclose(asc(x, (4, 5)), _mixer(**kw, backend=backend)(x, (4, 5)), atol=1e-6)


@pytest.mark.parametrize("name", ["v1", "v3", "v6"])
@pytest.mark.parametrize("k", [2, 5])
def test_k_steps_of_a_linear_loss_are_one_step_of_k_times_the_update(name, k):
    # With the dot-product loss and only the last layer stepping (V1, V3, V6; also the conv branch), the loss is
    # linear in the stepped weights: its gradient G does not depend on them, so k steps give W - k N(G) exactly,
    # with or without the normalisation N (N is a function of G alone).
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    m = _mixer(**VARIANTS[name], inner_steps=k)
    one = _mixer(**VARIANTS[name])
    torch.testing.assert_close(m(x, (4, 5)), autograd_reference(one, x, (4, 5), lr=float(k)), rtol=1e-12, atol=1e-13)
    if not one.normalize_grad:  # no N: k N(G) = N(k G), i.e. one step with the loss scale times k
        one.scale = k * one.scale
        torch.testing.assert_close(m(x, (4, 5)), one(x, (4, 5)), rtol=1e-12, atol=1e-13)
    else:  # with N, scaling the loss is not scaling the update: the identity needs the step size k
        one.scale = k * one.scale
        assert not torch.allclose(m(x, (4, 5)), one(x, (4, 5)), atol=1e-6)


def test_k_steps_of_the_full_swiglu_are_not_one_big_step():
    # negative control: the baseline's gate moves between steps, so its gradient does
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    m, one = _mixer(inner_steps=3), _mixer()
    assert not torch.allclose(m(x, (4, 5)), autograd_reference(one, x, (4, 5), lr=3.0), atol=1e-6)


def test_set_inner_steps_reaches_every_mixer():
    model = timm.create_model("vit3_tiny_v1", num_classes=4, depth=2, embed_dim=64, num_heads=2)
    x = torch.randn(1, 3, 32, 32)
    out1 = model(x)
    model.set_inner_steps(4)
    assert all(b.attn.inner_steps == 4 for b in model.blocks)
    assert not torch.allclose(model(x), out1)
    model.set_inner_steps(1)
    torch.testing.assert_close(model(x), out1)
    with pytest.raises(ValueError, match="inner_steps"):
        model.set_inner_steps(0)
    dit = timm.create_model("dit3_s_2", input_size=8, depth=1)
    set_inner_steps(dit, 2)
    assert dit.blocks[0].attn.inner_steps == 2


# ------------------------------------------------------------------------------------------------------- Q := K
def test_share_qk_drops_the_query_third_of_qkv():
    base, qk = ViT3TTT(96, num_heads=3), ViT3TTT(96, num_heads=3, share_qk=True)
    c, d = 96, 32
    assert base.qkv.weight.shape == (3 * (c + d), c) and qk.qkv.weight.shape == (2 * (c + d), c)
    n_base, n_qk = (sum(p.numel() for p in m.parameters()) for m in (base, qk))
    assert n_base - n_qk == (c + d) * c + (c + d)  # the query rows (weight and bias) of both branches


@pytest.mark.parametrize("rope", [False, True])
def test_share_qk_equals_baseline_with_keys_as_queries(rope):
    base = _mixer(rope=rope)
    qk = _mixer(rope=rope, share_qk=True)
    with pytest.raises(CheckpointError, match="shape mismatch"):
        validate_state_dict(base.state_dict(), qk)
    qk.load_state_dict(variant_state_dict(base.state_dict(), qk))
    c, d = base.dim, base.head_dim
    with torch.no_grad():  # the baseline with its query rows set to the key rows
        for t in (base.qkv.weight, base.qkv.bias):
            t[:c] = t[c:2 * c]
            t[3 * c:3 * c + d] = t[3 * c + d:3 * c + 2 * d]
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    torch.testing.assert_close(qk(x, (4, 5)), base(x, (4, 5)), rtol=1e-12, atol=1e-13)


def test_linear_has_no_gate_and_filter_drops_it():
    m = ViT3TTT(32, num_heads=2, inner_model="linear")
    assert m.w2 is None and "w2" not in m.state_dict()
    sd = variant_state_dict(ViT3TTT(32, num_heads=2).state_dict(), m)
    m.load_state_dict(sd)  # strict


# -------------------------------------------------------------------------------------------- options, models
@pytest.mark.parametrize("kw, match", [
    (dict(inner_update="first"), "inner_update"),
    (dict(inner_model="mlp"), "inner_model"),
    (dict(inner_steps=0), "inner_steps"),
    (dict(inner_steps=1.5), "inner_steps"),
])
def test_bad_options_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        ViT3TTT(32, num_heads=2, **kw)


def test_named_variant_with_another_mixer_raises():
    with pytest.raises(ValueError, match="options of the 'vit3' mixer"):
        timm.create_model("vit3_tiny_v1", mixer="t5")


def test_defaults_take_the_baseline_op():
    assert not ViT3TTT(32, num_heads=2).is_variant
    assert ViT3TTT(32, num_heads=2, normalize_grad=False).is_variant is False  # an option ViT3 already had


@pytest.mark.parametrize("name, options", [
    ("vit3_tiny_v1", dict(inner_update="last", inner_model="swiglu", normalize_grad=True)),
    ("vit3_small_v3", dict(inner_update="last", inner_model="linear", normalize_grad=True)),
    ("vit3_base_v6", dict(inner_update="last", inner_model="linear", normalize_grad=False)),
    ("hvit3_tiny_v6", dict(inner_update="last", inner_model="linear", normalize_grad=False, use_rope=True)),
])
def test_named_models(name, options):
    assert name in ttt_zoo.list_zoo_models() and timm.is_model(name)
    with torch.device("meta"):
        model = timm.create_model(name)
    mixers = [m for m in model.modules() if isinstance(m, ViT3TTT)]
    assert mixers and all(getattr(m, k) == v for m in mixers for k, v in options.items())
    # the caller's mixer_kwargs join the variant's
    with torch.device("meta"):
        m2 = timm.create_model(name, mixer_kwargs=dict(gradient_ascent=True))
    assert all(m.gradient_ascent and m.inner_update == "last" for m in m2.modules() if isinstance(m, ViT3TTT))
