"""Vision-TTT paper variants: the plain linear-attention mixer (inner_loss='dot') against a per-token autograd
inner loop (tests/_ops.py), gradient ascent, inner steps, and the variants that do not apply."""
import pytest
import timm
import torch

from _ops import autograd_dot_scan
from ttt_zoo.kernels import token_tau
from ttt_zoo.layers.ttt_linear import TTTLinearMixer

DT = torch.float64


def _mixer(**kw):
    m = TTTLinearMixer(16, head_dim=8, mini_batch=8, **kw).to(DT)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def _bidir_naive(m, x, feat):
    q, k, v, lr, _ = m.inner_inputs(x, feat)
    tau = token_tau(m.tau_offset)
    sign = -1.0 if m.gradient_ascent else 1.0
    lr = lr * sign * m.inner_steps
    fw = autograd_dot_scan(q, k, v, lr, tau, m.w0[:1], m.b0[:1], m.mini_batch)
    i = m.w0.shape[0] - 1
    bw = autograd_dot_scan(q.flip(2), k.flip(2), v.flip(2), lr.flip(2), tau, m.w0[i:], m.b0[i:], m.mini_batch).flip(2)
    return fw + bw


CASES = [((5, 7), kw, be) for kw in (dict(), dict(gradient_ascent=True), dict(inner_steps=3, w0_mode="separate"))
         for be in ("torch", "torch_naive")] + [((56, 56), dict(), "torch")]  # 3136 tokens, both directions


@pytest.mark.parametrize("feat,kw,backend", CASES)
def test_la_mixer_vs_autograd_inner_loop(feat, kw, backend):
    m = _mixer(inner_loss="dot", inner_rope=False, backend=backend, **kw)
    x = torch.randn(1, feat[0] * feat[1], 16, dtype=DT)
    z, _ = m._scan(*m.inner_inputs(x, feat)[:4])
    ref = _bidir_naive(m, x, feat)
    assert (z - ref).abs().max().item() < 1e-10 * max(1.0, ref.abs().max().item())


def test_la_ascent_equals_descent_with_v_negated():
    """Exact for the dot-product loss (its gradient is -v, linear in v); not for the LayerNorm loss."""
    a, d = _mixer(inner_loss="dot", gradient_ascent=True), _mixer(inner_loss="dot")
    d.load_state_dict(a.state_dict())
    x = torch.randn(2, 35, 16, dtype=DT)
    q, k, v, lr, _ = a.inner_inputs(x, (5, 7))
    za, _ = a._scan(q, k, v, lr)
    zd, _ = d._scan(q, k, -v, lr)
    wd, _ = d._scan(q, k, v, lr)
    # the initial state's read q W0 + b0 is not negated: compare the state-update parts
    z0, _ = d._scan(q, k, v * 0, lr)
    torch.testing.assert_close(za - z0, -(wd - z0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(za, zd, rtol=1e-12, atol=1e-12)


def test_la_k_steps_equal_one_step_with_k_times_the_lr():
    """Exact because the dot-product gradient does not depend on the state."""
    m = _mixer(inner_loss="dot")
    x = torch.randn(2, 35, 16, dtype=DT)
    q, k, v, lr, _ = m.inner_inputs(x, (5, 7))
    m.inner_steps = 4
    z4, _ = m._scan(q, k, v, lr)
    m.inner_steps = 1
    z1, _ = m._scan(q, k, v, 4 * lr)
    torch.testing.assert_close(z4, z1, rtol=1e-12, atol=1e-12)


def test_mse_gradient_ascent_is_the_negated_update():
    """Baseline TTT-Linear: ascent == the per-token lr negated (checked against the naive scan op)."""
    from ttt_zoo.kernels.ttt_linear import ttt_linear_bidir_naive
    m = _mixer(gradient_ascent=True, backend="torch")
    x = torch.randn(2, 35, 16, dtype=DT)
    q, k, v, lr, _ = m.inner_inputs(x, (5, 7))
    z, _ = m._scan(q, k, v, lr)
    ref, _ = ttt_linear_bidir_naive(q, k, v, -lr, token_tau(m.tau_offset), m.w0, m.b0, m.ttt_norm_weight,
                                    m.ttt_norm_bias, 8, True, 10000.0, 1e-6, False)
    torch.testing.assert_close(z, ref, rtol=1e-10, atol=1e-10)
    m.gradient_ascent = False
    assert (m._scan(q, k, v, lr)[0] - z).abs().max() > 1e-4


@pytest.mark.parametrize("kw,match", [(dict(inner_update="last"), "Variant 1"), (dict(inner_model="linear"), "Variant 3"),
                                      (dict(normalize_grad=True), "normalize_grad"), (dict(share_qk=True), "q = k"),
                                      (dict(inner_steps=2), "inner_loss='dot'"),
                                      (dict(inner_loss="dot", inner_ln_residual=True), "no inner LayerNorm")])
def test_not_applicable_variants_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        TTTLinearMixer(16, head_dim=8, **kw)
    m = TTTLinearMixer(16, head_dim=8)
    with pytest.raises(ValueError, match="inner_loss='dot'"):
        m.inner_steps = 2


def test_la_models():
    m = timm.create_model("visionttt_tiny_la", img_size=64, num_classes=5).eval()
    mixer = m.blocks[0].attn
    assert mixer.inner_loss == "dot" and not hasattr(mixer, "ttt_norm_weight")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.script(m)(x), m(x), rtol=1e-5, atol=1e-5)
    f = timm.create_model("visionttt_h_tiny_la", features_only=True, pretrained=False)
    assert [t.shape[1] for t in f(torch.randn(1, 3, 64, 64))] == [96, 192, 384, 768]
    with pytest.raises(ValueError, match="'ttt_linear' mixer"):
        timm.create_model("visionttt_tiny_la", mixer="t5")
