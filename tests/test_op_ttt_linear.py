"""TTT-Linear (Vision-TTT): the mini-batch dual form against a naive sequential primal reference.

The reference below is written independently of ``kernels/ttt_linear``: it runs explicit mini-batch gradient
descent on (W, b) token by token, with each token's gradient obtained by autograd of its own loss.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ttt_zoo.kernels import ttt_linear_bidir, ttt_linear_reference
from ttt_zoo.kernels.ttt_linear import ttt_linear_naive
from ttt_zoo.layers import create_mixer

TOL = 1e-10


# ----------------------------------------------------------------------------- naive reference
def naive_rope(x, mini_batch, theta=10000.0):
    """(B, H, N, d): rotate channel pair (p, p + d/2) by (t mod b) * theta^(-2p/d)."""
    n, d = x.shape[2], x.shape[3]
    half = d // 2
    ang = torch.tensor([[(t % mini_batch) * theta ** (-2.0 * p / d) for p in range(half)] for t in range(n)],
                       dtype=x.dtype)
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def naive_scan(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual=True, eps=1e-6):
    """Primal mini-batch GD: token i of a mini-batch reads W_0 - tau_i sum_{j<=i} lr_j grad l_j(W_0)."""
    bsz, heads, n, d = q.shape
    lnw, lnb = ln_w.view(1, heads, 1, d), ln_b.view(1, heads, 1, d)

    def inner(x, w, b):
        z = x @ w + b
        return x + F.layer_norm(z, (d,), eps=eps) * lnw + lnb if ln_residual else z

    w = w0.expand(bsz, heads, d, d).clone()
    b = b0.expand(bsz, heads, 1, d).clone()
    out = torch.empty_like(q)
    grad_norm = torch.empty(bsz, heads, n, dtype=q.dtype)
    for s in range(0, n, mini_batch):
        e = min(s + mini_batch, n)
        # one private copy of the mini-batch's incoming (W, b) per token: the gradient of token t's own loss
        wl = w.detach()[:, :, None].expand(bsz, heads, e - s, d, d).clone().requires_grad_()
        bl = b.detach()[:, :, None].expand(bsz, heads, e - s, 1, d).clone().requires_grad_()
        kt, vt = k[:, :, s:e, None], v[:, :, s:e, None]  # (B, H, c, 1, d)
        if ln_residual:
            z = kt @ wl + bl
            pred = F.layer_norm(z, (d,), eps=eps) * lnw[:, :, None] + lnb[:, :, None]
            loss = 0.5 * (pred - (vt - kt)).pow(2).sum()
        else:
            loss = 0.5 * (kt @ wl + bl - vt).pow(2).sum()
        gws, gbs = torch.autograd.grad(loss, (wl, bl))
        sum_w, sum_b = torch.zeros_like(w), torch.zeros_like(b)
        for t in range(s, e):  # sequential primal updates, token by token
            i = t - s
            gw, gb = gws[:, :, i], gbs[:, :, i]
            grad_norm[:, :, t] = gw.flatten(2).norm(dim=-1)
            sum_w = sum_w + lr[:, :, t, None, None] * gw
            sum_b = sum_b + lr[:, :, t, None, None] * gb
            out[:, :, t:t + 1] = inner(q[:, :, t:t + 1], w - tau[i] * sum_w, b - tau[i] * sum_b)
        w, b = w - tau[i] * sum_w, b - tau[i] * sum_b
    return out, grad_norm


def naive_bidir(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch, ln_residual=True, rope=True):
    """Returns (forward-direction out, backward-direction out in original order, grad norms of both)."""
    outs, norms = [], []
    for direction in (0, 1):
        qd, kd, vd, lrd = q, k, v, lr
        if direction:
            qd, kd, vd, lrd = q.flip(2), k.flip(2), v.flip(2), lr.flip(2)
        if rope:
            qd, kd = naive_rope(qd, mini_batch), naive_rope(kd, mini_batch)
        i = min(direction, w0.shape[0] - 1)
        o, g = naive_scan(qd, kd, vd, lrd, tau, w0[i:i + 1], b0[i:i + 1], ln_w, ln_b, mini_batch, ln_residual)
        outs.append(o.flip(2) if direction else o)
        norms.append(g.flip(2) if direction else g)
    return outs[0], outs[1], torch.stack(norms)


def naive_mixer(m, x, feat_size, return_norms=False):
    """The Vittt mixer written out with the naive scan, from the mixer's parameters."""
    bsz, n, c = x.shape
    h, w = feat_size
    d, heads, mb = m.head_dim, m.num_heads, m.mini_batch

    def conv(t):
        return F.conv2d(t.transpose(1, 2).reshape(bsz, c, h, w), m.conv.weight, padding=1,
                        groups=c).flatten(2).transpose(1, 2)

    src = conv(x) if m.qk_mode == "shared" else x
    u = src @ m.proj.weight.T + m.proj.bias
    u_qk, u_g, u_v = u[..., :c], u[..., c:2 * c], u[..., 2 * c:]
    logits = src @ m.lr_proj.weight.T + m.lr_proj.bias
    q_flat = conv(u_qk) if m.qk_mode == "conv_q" else u_qk

    def heads_of(t):
        return t.reshape(bsz, n, heads, d).permute(0, 2, 1, 3)

    q, k, v = heads_of(q_flat), heads_of(u_qk), heads_of(u_v)
    lr = m.base_lr * torch.sigmoid(logits).permute(0, 2, 1) / d
    tau = torch.clamp(1.0 / torch.arange(1, mb + 1, dtype=x.dtype) + m.tau_offset, min=0.0)
    zf, zb, norms = naive_bidir(q, k, v, lr, tau, m.w0, m.b0, m.ttt_norm_weight, m.ttt_norm_bias, mb,
                                m.inner_ln_residual, m.inner_rope)
    z = (zf + zb).permute(0, 2, 1, 3).reshape(bsz, n, c)
    z = F.layer_norm(z, (c,), m.post_norm.weight, m.post_norm.bias, eps=1e-6)
    gelu = 0.5 * u_g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u_g + 0.044715 * u_g ** 3)))
    out = (gelu * z) @ m.o_proj.weight.T + m.o_proj.bias
    return (out, norms) if return_norms else out


# ----------------------------------------------------------------------------- helpers
def _inputs(bsz, heads, n, d, mb, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(bsz, heads, n, d), r(bsz, heads, n, d), r(bsz, heads, n, d)
    lr = torch.sigmoid(r(bsz, heads, n)) * 0.5  # large steps so the updates matter
    tau = torch.clamp(1.0 / torch.arange(1, mb + 1, dtype=torch.float64) + 0.1 * r(mb), min=0)
    ln_w, ln_b = 1 + 0.3 * r(heads, d), 0.3 * r(heads, d)
    return q, k, v, lr, tau, ln_w, ln_b, r


def _randomize(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name in ("w0",):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name == "tau_offset":
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif p.dim() == 1 or name in ("b0", "ttt_norm_weight", "ttt_norm_bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p[0].numel()))
    return m


# ----------------------------------------------------------------------------- op tests
@pytest.mark.parametrize("n", [49, 196, 197])
@pytest.mark.parametrize("ln_residual", [True, False])
def test_dual_form_matches_naive_one_direction(n, ln_residual):
    heads, d, mb = 3, 32, 16
    q, k, v, lr, tau, ln_w, ln_b, r = _inputs(2, heads, n, d, mb, seed=n)
    w0, b0 = 0.3 * r(2, heads, d, d), 0.3 * r(2, heads, 1, d)  # a different W0 per sample
    out, gn = ttt_linear_reference(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual, return_grad_norm=True)
    ref, ref_gn = naive_scan(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)
    assert (out - ref).abs().max().item() < TOL
    assert (gn - ref_gn).abs().max().item() < TOL
    plain, plain_gn = ttt_linear_naive(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual, return_grad_norm=True)
    assert (plain - ref).abs().max().item() < TOL and (plain_gn - ref_gn).abs().max().item() < TOL
    shared, _ = ttt_linear_reference(k, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)  # the q = k path
    shared_ref, _ = ttt_linear_naive(k, k.clone(), v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)
    assert (shared - shared_ref).abs().max().item() < TOL
    # the inner updates are not negligible: without them the output would be far off
    frozen, _ = ttt_linear_reference(q, k, v, 0 * lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)
    assert (frozen - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize("n", [49, 196, 197])
@pytest.mark.parametrize("n_w0,d", [(1, 64), (2, 32)])
def test_bidir_matches_naive_both_directions(n, n_w0, d):
    heads, mb = 2, 16
    q, k, v, lr, tau, ln_w, ln_b, r = _inputs(2, heads, n, d, mb, seed=3 * n + d)
    w0, b0 = 0.3 * r(n_w0, heads, d, d), 0.3 * r(n_w0, heads, 1, d)
    out, gn = ttt_linear_bidir(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, True, 10000.0, return_grad_norm=True)
    zf, zb, ref_gn = naive_bidir(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb)
    assert (out - (zf + zb)).abs().max().item() < TOL
    assert (gn - ref_gn).abs().max().item() < TOL
    # each direction alone: the backward scan equals the naive scan of the flipped sequence
    assert (zf - zb).abs().max().item() > 1e-2
    only_f, _ = ttt_linear_bidir(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, True, 10000.0)
    assert (only_f - zf - zb).abs().max().item() < TOL


def test_rejects_bad_shapes():
    q, k, v, lr, tau, ln_w, ln_b, r = _inputs(1, 2, 20, 8, 4)
    w0, b0 = r(1, 2, 8, 8), r(1, 2, 1, 8)
    with pytest.raises(ValueError, match="tau"):
        ttt_linear_reference(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch=16)
    with pytest.raises(ValueError, match="lr"):
        ttt_linear_reference(q, k, v, lr[..., :5], tau, w0, b0, ln_w, ln_b, mini_batch=4)
    with pytest.raises(ValueError, match="w0"):
        ttt_linear_reference(q, k, v, lr, tau, r(1, 2, 4, 8), b0, ln_w, ln_b, mini_batch=4)


def test_memory_is_linear_in_tokens():
    """Saved activations grow linearly in N and no tensor of N x d x d elements is ever kept."""
    d, mb = 64, 16

    def saved(n):
        sizes = []
        q, k, v, lr, tau, ln_w, ln_b, r = _inputs(1, 1, n, d, mb)
        ins = [t.requires_grad_() for t in (q, k, v, lr, r(1, 1, d, d), r(1, 1, 1, d))]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            ttt_linear_reference(ins[0], ins[1], ins[2], ins[3], tau, ins[4], ins[5], ln_w, ln_b, mb)
        return sum(sizes), max(sizes)

    small, big = saved(256), saved(1024)
    # largest saved tensor: the per-mini-batch states (N/b x d x d, Eq. 15's BTd^2/b), never N x d x d
    assert big[1] <= 1024 * d * d // mb
    assert big[0] < 4.5 * small[0]


# ----------------------------------------------------------------------------- mixer tests
@pytest.mark.parametrize("feat_size", [(7, 7), (14, 14), (1, 197)])
@pytest.mark.parametrize("w0_mode", ["shared", "separate", "frozen"])
def test_mixer_matches_naive(feat_size, w0_mode):
    dim, head_dim = (128, 64) if feat_size == (7, 7) else (64, 32)
    m = create_mixer("ttt_linear", dim, head_dim=head_dim, w0_mode=w0_mode, base_lr=8.0).double()
    _randomize(m, seed=len(w0_mode))
    x = torch.randn(2, feat_size[0] * feat_size[1], dim, dtype=torch.float64)
    out = m(x, feat_size)
    ref = naive_mixer(m, x, feat_size)
    assert (out - ref).abs().max().item() < TOL
    if w0_mode == "frozen":
        assert not any(n in ("w0", "b0") for n, _ in m.named_parameters())
        assert float(m.w0.abs().max()) == 0.0


@pytest.mark.parametrize("opts", [dict(qk_mode="conv_q"), dict(inner_rope=False), dict(inner_ln_residual=False),
                                  dict(proj_per_direction=True), dict(mini_batch=8, head_dim=16)])
def test_mixer_options_match_naive(opts):
    m = create_mixer("ttt_linear", 64, **dict(dict(head_dim=32, base_lr=8.0), **opts)).double()
    _randomize(m, seed=1)
    x = torch.randn(2, 30, 64, dtype=torch.float64)
    assert (m(x, (5, 6)) - naive_mixer(m, x, (5, 6))).abs().max().item() < TOL


def test_proj_per_direction_is_identical():
    m = create_mixer("ttt_linear", 64, head_dim=32).double()
    x = torch.randn(1, 20, 64, dtype=torch.float64)
    y0 = m(x, (4, 5))
    m.proj_per_direction = True
    assert (m(x, (4, 5)) - y0).abs().max().item() < 1e-12


@pytest.mark.parametrize("w0_mode", ["shared", pytest.param("separate", marks=pytest.mark.slow)])
def test_mixer_gradcheck(w0_mode):
    """Full gradcheck w.r.t. the input and the TTT-only parameters; fast-mode gradcheck w.r.t. all parameters."""
    m = create_mixer("ttt_linear", 8, head_dim=4, mini_batch=4, base_lr=8.0, w0_mode=w0_mode).double()
    _randomize(m, seed=2)
    named = dict(m.named_parameters())
    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)  # 2 x 3 map: one full + one partial chunk

    def check(names, fast):
        params = tuple(named[n].detach().clone().requires_grad_() for n in names)

        def f(x, *ps):
            return torch.func.functional_call(m, dict(zip(names, ps)), (x, (2, 3)))

        return torch.autograd.gradcheck(f, (x,) + params, eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=fast)

    assert check([n for n in named if n.split(".")[0] in m.inner_param_names], fast=False)
    assert check(list(named), fast=True)


def test_mixer_interface_and_errors():
    m = create_mixer("ttt_linear", 96, head_dim=32)
    assert m.num_heads == 3
    assert set(n.split(".")[0] for n, _ in m.ttt_parameters()) == {"w0", "b0", "tau_offset", "ttt_norm_weight",
                                                                     "ttt_norm_bias", "lr_proj"}
    with pytest.raises(ValueError, match="feat_size"):
        m(torch.randn(1, 10, 96), (3, 3))
    with pytest.raises(ValueError, match="w0_mode"):
        create_mixer("ttt_linear", 64, w0_mode="bogus")
    with pytest.raises(ValueError, match="divisible"):
        create_mixer("ttt_linear", 96, head_dim=64)
    with pytest.raises(ValueError, match="qk_mode"):
        create_mixer("ttt_linear", 64, qk_mode="x")


def test_low_precision_inputs_use_fp32_state():
    q, k, v, lr, tau, ln_w, ln_b, r = _inputs(1, 2, 40, 32, 16)
    args = [t.float() for t in (q, k, v, lr, tau, 0.3 * r(1, 2, 32, 32), 0.3 * r(1, 2, 1, 32), ln_w, ln_b)]
    ref, _ = ttt_linear_reference(*args)
    low = [t.bfloat16() if i < 3 else t for i, t in enumerate(args)]
    out, _ = ttt_linear_reference(*low)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 0.1 * ref.abs().max().item()
