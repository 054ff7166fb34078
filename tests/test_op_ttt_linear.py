"""The TTT-Linear scan op of Vision-TTT (``kernels/ttt_linear``): every path against the reference.

The reference below is written independently of ``kernels/ttt_linear``: it runs explicit mini-batch gradient
descent on (W, b) token by token, with each token's gradient obtained by autograd of its own loss.

Then: the recomputing PyTorch scan (analytic backward) against autograd of the reference in float64, gradcheck of
every custom autograd Function and custom op on tiny shapes, the custom ops' schema / fake kernels (opcheck), the
backend table; and the Triton kernels (under TRITON_INTERPRET=1 without a GPU) forward and every input/weight
gradient (q, k, v, lr, tau, w0, b0, ln_w, ln_b) through the public wrappers, tight in float32, looser in float16,
over N % mini_batch != 0, H != W at the mixer level, head dims 16-72, shared / per-direction / per-sample w0, the
plain linear inner model and in-chunk RoPE; torch.compile over the op, the meta device and an empty batch.
"""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from _ops import BACKENDS, DEV, compare_kernel, triton_kernels, triton_test
from ttt_zoo.kernels import BackendError, get_op, ttt_linear, ttt_linear_bidir
from ttt_zoo.kernels.backend import MAX_HEAD_DIM
from ttt_zoo.kernels.ttt_linear import ops, ttt_linear_naive
from ttt_zoo.kernels.ttt_linear import torch as R
from ttt_zoo.kernels.ttt_linear.common import token_tau
from ttt_zoo.kernels.ttt_linear.naive import ttt_linear_bidir_naive
from ttt_zoo.kernels.ttt_linear.torch import ttt_linear_bidir_chunked as reference_bidir
from ttt_zoo.kernels.ttt_linear.torch import ttt_linear_chunked, ttt_linear_torch
from ttt_zoo.layers import create_mixer

T = triton_kernels("ttt_linear")


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
    out, gn = ttt_linear_chunked(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual, return_grad_norm=True)
    ref, ref_gn = naive_scan(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)
    assert (out - ref).abs().max().item() < TOL
    assert (gn - ref_gn).abs().max().item() < TOL
    plain, plain_gn = ttt_linear_naive(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual, return_grad_norm=True)
    assert (plain - ref).abs().max().item() < TOL and (plain_gn - ref_gn).abs().max().item() < TOL
    shared, _ = ttt_linear_chunked(k, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)  # the q = k path
    shared_ref, _ = ttt_linear_naive(k, k.clone(), v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)
    assert (shared - shared_ref).abs().max().item() < TOL
    # the inner updates are not negligible: without them the output would be far off
    frozen, _ = ttt_linear_chunked(q, k, v, 0 * lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)
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
        ttt_linear_chunked(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mini_batch=16)
    with pytest.raises(ValueError, match="lr"):
        ttt_linear_chunked(q, k, v, lr[..., :5], tau, w0, b0, ln_w, ln_b, mini_batch=4)
    with pytest.raises(ValueError, match="w0"):
        ttt_linear_chunked(q, k, v, lr, tau, r(1, 2, 4, 8), b0, ln_w, ln_b, mini_batch=4)


def test_memory_is_linear_in_tokens():
    """Saved activations grow linearly in N and no tensor of N x d x d elements is ever kept."""
    d, mb = 64, 16

    def saved(n):
        sizes = []
        q, k, v, lr, tau, ln_w, ln_b, r = _inputs(1, 1, n, d, mb)
        ins = [t.requires_grad_() for t in (q, k, v, lr, r(1, 1, d, d), r(1, 1, 1, d))]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            ttt_linear_chunked(ins[0], ins[1], ins[2], ins[3], tau, ins[4], ins[5], ln_w, ln_b, mb)
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
    ref, _ = ttt_linear_chunked(*args)
    low = [t.bfloat16() if i < 3 else t for i, t in enumerate(args)]
    out, _ = ttt_linear_chunked(*low)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 0.1 * ref.abs().max().item()


# ------------------------------------------------------------ the recomputing scan, its Functions and custom ops
NAMES = ("q", "k", "v", "lr", "tau", "w0", "b0", "ln_w", "ln_b")


def make_inputs(b, h, n, d, mb, n_w0, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)

    def r(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale + shift).to(dtype)
    return [r(b, h, n, d), r(b, h, n, d), r(b, h, n, d), (torch.rand(b, h, n, generator=g, dtype=torch.float64) * 0.3
            ).to(dtype), (torch.rand(mb, generator=g, dtype=torch.float64) + 0.2).to(dtype),
            r(n_w0, h, d, d, scale=0.1), r(n_w0, h, 1, d, scale=0.1), r(h, d, scale=0.3, shift=1.0),
            r(h, d, scale=0.1)]


def grads_of(fn, inputs, do=None, shared_qk=False):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    args = list(leaves)
    if shared_qk:
        args[1] = args[0]
    out = fn(*args)
    do = torch.randn_like(out) if do is None else do
    gs = torch.autograd.grad(out, leaves, do, allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, gs)], do


CASES = [  # (B, heads, N, d, mini_batch, w0 leading dim, ln_residual)
    (2, 2, 13, 8, 4, 1, True),     # N % mini_batch != 0, shared w0
    (3, 1, 8, 4, 4, 3, True),      # per-sample w0 (causal) / per-direction (bidir)
    (1, 2, 9, 6, 4, 1, False),     # the paper's plain linear inner model
    (1, 1, 37, 4, 4, 1, True),     # 10 mini-batches: checkpoints every 4, a partial last segment
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}h{}N{}d{}b{}w{}{}".format(*c[:6], "ln" if c[6] else ""))
@pytest.mark.parametrize("bidir", [False, True], ids=["causal", "bidir"])
def test_recompute_matches_reference_autograd(case, bidir):
    b, h, n, d, mb, nw, ln_res = case
    if bidir:
        nw = min(nw, 2)
        new = lambda *a: R.ttt_linear_bidir_torch(*a, mb, ln_res, 10000.0)[0]  # noqa: E731
        ref = lambda *a: reference_bidir(*a, mb, ln_res, 10000.0)[0]  # noqa: E731
    else:
        new = lambda *a: R.ttt_linear_torch(*a, mb, ln_res)[0]  # noqa: E731
        ref = lambda *a: ttt_linear_chunked(*a, mb, ln_res)[0]  # noqa: E731
    inputs = make_inputs(b, h, n, d, mb, nw)
    for shared_qk in (False, True):
        out, gs, do = grads_of(new, inputs, shared_qk=shared_qk)
        rout, rgs, _ = grads_of(ref, inputs, do, shared_qk=shared_qk)
        torch.testing.assert_close(out, rout, atol=1e-12, rtol=1e-10)
        for name, g, r in zip(NAMES, gs, rgs):
            torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("shared_qk", [True, False], ids=["shared_qk", "separate_qk"])
def test_bidir_rope_scan_saves_inputs_not_rotated_copies(shared_qk):
    """With in-chunk RoPE the training scan keeps its own inputs and the checkpoint states only: no rotated q/k copy
    per direction and no cos/sin table (the backward rotates again)."""
    b, h, n, d, mb = 1, 2, 64, 8, 8
    leaves = [t.requires_grad_() for t in make_inputs(b, h, n, d, mb, 1)]
    args = list(leaves)
    if shared_qk:
        args[1] = args[0]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = R.ttt_linear_bidir_torch(*args, mb, True, 10000.0)[0]
    inputs = {t.data_ptr() for t in args}
    others = [tuple(t.shape) for t in saved if t.data_ptr() not in inputs]
    n_ck = -(-(n // mb) // R.ckpt_every(n // mb))
    assert others == [(2 * b, h, n_ck, d + 1, d)], others  # the states of both directions
    ref = reference_bidir(*args, mb, True, 10000.0)[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bidir_rope_scan_keeps_low_precision_dtypes(dtype):
    """Training path in half precision: the output and every gradient keep their input's dtype, and the result is
    the float64 reference's to half-precision accuracy (the state runs in fp32)."""
    b, h, n, d, mb = 1, 2, 64, 8, 8
    leaves = [t.to(dtype).requires_grad_() for t in make_inputs(b, h, n, d, mb, 1)]
    args = [leaves[0], leaves[0]] + leaves[2:]
    out = R.ttt_linear_bidir_torch(*args, mb, True, 10000.0)[0]
    assert out.dtype == dtype
    grads = torch.autograd.grad(out.float().sum(), [leaves[0]] + leaves[2:])
    assert [g.dtype for g in grads] == [dtype] * len(grads)
    ref = reference_bidir(*[a.detach().double() for a in args], mb, True, 10000.0)[0]
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2


@pytest.mark.parametrize("ln_res", [True, False], ids=["ln", "plain"])
def test_gradcheck_tiny(ln_res):
    inputs = [t.requires_grad_() for t in make_inputs(1, 1, 5, 4, 2, 2)]
    assert torch.autograd.gradcheck(lambda *a: R.ttt_linear_bidir_torch(*a, 2, ln_res, 10000.0)[0], inputs,
                                    fast_mode=True)
    # the custom ops' PyTorch kernel (float64 never takes the Triton path)
    assert torch.autograd.gradcheck(lambda *a: ops.ttt_linear_bidir_op(*a, 2, ln_res, None)[0], inputs,
                                    fast_mode=True)


@pytest.mark.parametrize("shared_qk", [True, False], ids=["shared_qk", "separate_qk"])
def test_op_rope_inside_matches_naive_and_gradchecks(shared_qk):
    # the ops take q, k unrotated and turn them themselves (rope_theta); their PyTorch path in float64 against the
    # float64 reference (which rotates before the scan), N % b != 0, and gradcheck of the turn and its inverse
    inputs = [t.requires_grad_() for t in make_inputs(2, 1, 7, 4, 3, 2)]
    if shared_qk:
        inputs[1] = inputs[0]
    out = ops.ttt_linear_bidir_op(*inputs, 3, True, 10000.0)[0]
    torch.testing.assert_close(out, ttt_linear_bidir_naive(*inputs, mini_batch=3)[0], rtol=1e-10, atol=1e-10)
    leaves = [inputs[0]] + inputs[2:] if shared_qk else inputs
    fn = (lambda q, *r: ops.ttt_linear_bidir_op(q, q, *r, 3, True, 10000.0)[0]) if shared_qk else \
        (lambda *a: ops.ttt_linear_bidir_op(*a, 3, True, 10000.0)[0])
    assert torch.autograd.gradcheck(fn, leaves, fast_mode=True)
    with pytest.raises(ValueError, match="rope_theta"):
        ops.ttt_linear_bidir_op(*inputs, 3, True, 0.0)


def test_opcheck_fake_kernels():
    x = make_inputs(2, 1, 23, 4, 4, 1, torch.float32)
    q2, k2, w2, b2 = R.bidir_inputs(x[0], x[1], x[5], x[6], 4, 10000.0)
    args = [q2, k2, x[2], x[3], x[4], w2, b2, x[7], x[8], 2, 4, True, 1e-6]
    torch.library.opcheck(torch.ops.ttt_zoo.ttt_linear_scan_fwd.default, args + [True, False],
                          test_utils=("test_schema", "test_faketensor"))
    out, st = torch.ops.ttt_zoo.ttt_linear_scan_fwd(*args, True, False)
    # 6 mini-batches, a checkpoint every max(4, ceil(6 / 32)) = 4: (ndir B, heads, 2, d + 1, d)
    assert st.shape == (4, 1, 2, 5, 4) and R.ckpt_every(6) == 4 and R.ckpt_every(4096) == 128
    torch.library.opcheck(torch.ops.ttt_zoo.ttt_linear_scan_bwd.default, [torch.randn_like(out)] + args[:9] + [st]
                          + args[9:] + [False], test_utils=("test_schema", "test_faketensor"))


def test_fake_kernel_sizes_stay_symbolic():
    """Under torch.compile(dynamic=True) the scan op's fake kernel sizes the saved states by a formula of the token
    count (integer ops only): one graph serves every length and gives the real op's sizes.  (A sqrt rule was fixed
    to the traced size: a graph per length, and inside a model, whose token count is a product of sizes, a wrong
    size at the next length.)"""
    def states_like(*args):
        st = torch.ops.ttt_zoo.ttt_linear_scan_fwd(*args, 2, 4, True, 1e-6, True, False)[1]
        return st.new_zeros(st.shape)  # sized by the fake kernel's formula

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(states_like, backend="aot_eager", dynamic=True)
    for n in (23, 200, 600, 3000):
        x = make_inputs(2, 1, n, 4, 4, 1, torch.float32)
        q2, k2, w2, b2 = R.bidir_inputs(x[0], x[1], x[5], x[6], 4, 10000.0)
        args = [q2, k2, x[2], x[3], x[4], w2, b2, x[7], x[8]]
        real = torch.ops.ttt_zoo.ttt_linear_scan_fwd(*args, 2, 4, True, 1e-6, True, False)[1]
        assert compiled(*args).shape == real.shape, n
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_dispatch_table():
    cpu = torch.device("cpu")
    assert get_op("ttt_linear", cpu) is R.ttt_linear_torch
    assert get_op("ttt_linear", cpu, "torch_naive") is ttt_linear_naive
    assert get_op("ttt_linear_bidir", cpu) is R.ttt_linear_bidir_torch
    assert get_op("ttt_linear_bidir", torch.device("meta")) is R.ttt_linear_bidir_torch
    assert get_op("ttt_linear_bidir", cpu, "torch_naive") is ttt_linear_bidir_naive


@triton_test
def test_dispatch_table_triton():
    assert get_op("ttt_linear_bidir", torch.device("cpu"), "triton") is ops.ttt_linear_bidir_op


def test_grad_norm_map_runs_reference():
    x = make_inputs(1, 2, 10, 4, 4, 1)
    out, gn = ttt_linear_bidir(*x, mini_batch=4, return_grad_norm=True)
    rout, rgn = reference_bidir(*x, 4, return_grad_norm=True)
    torch.testing.assert_close(out, rout)
    torch.testing.assert_close(gn, rgn)


def test_bad_inputs_raise():
    x = make_inputs(2, 2, 8, 4, 4, 1)
    with pytest.raises(ValueError, match="lr must be"):
        R.ttt_linear_bidir_torch(x[0], x[1], x[2], x[3][:, :, :5], *x[4:], 4)
    with pytest.raises(ValueError, match="leading dim of 1"):
        R.ttt_linear_bidir_torch(*x[:5], x[5].expand(3, -1, -1, -1), x[6].expand(3, -1, -1, -1), *x[7:], 4)
    with pytest.raises(ValueError, match="w0 must be"):
        R.ttt_linear_torch(*x[:5], x[5][..., :3], *x[6:], 4)


def test_inference_path_returns_no_grad_norm_unless_asked():
    b, h, n, d = 1, 2, 20, 8
    q, k, v = [torch.randn(b, h, n, d) for _ in range(3)]
    lr = torch.rand(b, h, n) * 0.1
    tau = token_tau(torch.zeros(8))
    w0, b0 = torch.randn(1, h, d, d) * 0.1, torch.zeros(1, h, 1, d)
    ln_w, ln_b = torch.ones(h, d), torch.zeros(h, d)
    with torch.no_grad():
        out, gn = ttt_linear_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, 8)
        ref, _ = ttt_linear_chunked(q, k, v, lr, tau, w0, b0, ln_w, ln_b, 8)
        _, gn2 = ttt_linear_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, 8, return_grad_norm=True)
    assert gn is None and gn2.shape == (b, h, n)
    torch.testing.assert_close(out, ref)


# ------------------------------------------------------------ Triton kernels
KTOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture
def count_launches(monkeypatch):
    """Make sure the Triton kernels (not the PyTorch fallback) really ran."""
    for op in ("ttt_linear", "ttt_linear_bidir"):  # also run the d = 72 case through the kernels
        monkeypatch.setitem(MAX_HEAD_DIM, op, 128)
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd = T.scan_fwd_triton, T.scan_bwd_triton

    def f(*a):
        calls["fwd"] += 1
        return fwd(*a)

    def b(*a):
        calls["bwd"] += 1
        return bwd(*a)
    monkeypatch.setattr(T, "scan_fwd_triton", f)
    monkeypatch.setattr(T, "scan_bwd_triton", b)
    return calls


def make_kernel_inputs(b, h, n, d, mb, n_w0):
    return [torch.randn(b, h, n, d), torch.randn(b, h, n, d), torch.randn(b, h, n, d), torch.rand(b, h, n) * 0.3,
            torch.rand(mb) + 0.2, torch.randn(n_w0, h, d, d) * 0.1, torch.randn(n_w0, h, 1, d) * 0.1,
            torch.randn(h, d) * 0.3 + 1.0, torch.randn(h, d) * 0.1]


def _compare(f_new, f_ref, inputs, dtype, calls):
    """Forward and all gradients (tests/_ops.py), in one forward and one backward launch."""
    compare_kernel(f_new, f_ref, [t.to(DEV) for t in inputs], dtype, NAMES, KTOL, ref_may_skip=True)
    assert calls["fwd"] == 1 and calls["bwd"] == 1


BIDIR_CASES = [  # (B, heads, N, d, mini_batch, w0 leading dim, ln_residual, rope)
    (1, 2, 37, 16, 8, 1, True, True),     # N % b != 0 (partial last mini-batch), shared w0
    (3, 1, 37, 16, 16, 2, True, False),   # batch 3, per-direction w0, no RoPE
    (1, 1, 21, 32, 8, 2, False, True),    # head dim 32, the plain linear inner model
    (1, 1, 19, 64, 8, 1, True, True),     # head dim 64
    (1, 1, 13, 72, 4, 1, True, True),     # head dim 72 (padded to 128), mini-batch 4 (padded to 16)
]


@pytest.mark.parametrize("case", BIDIR_CASES, ids=lambda c: "B{}h{}N{}d{}b{}w{}{}{}".format(
    *c[:6], "ln" if c[6] else "", "rope" if c[7] else ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_bidir_kernels(case, dtype, count_launches):
    b, h, n, d, mb, nw, ln_res, rope = case
    if dtype == torch.float16 and d >= 64:
        pytest.skip("covered in fp32; keeps the interpreter run short")
    theta = 10000.0 if rope else None
    _compare(lambda *a: ttt_linear_bidir(*a, mini_batch=mb, ln_residual=ln_res, rope_theta=theta,
                                         backend="triton")[0],
             lambda *a: reference_bidir(*a, mb, ln_res, theta)[0], make_kernel_inputs(b, h, n, d, mb, nw), dtype,
             count_launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_bidir_kernels_read_strided_views(dtype, count_launches):
    """q, k, v as the mixer passes them, views of one token-major (B, N, 3, H, d) projection, and lr of (B, N, H)
    memory: the kernels read them with their strides (batch 2, so the batch strides count) and match the reference."""
    b, h, n, d, mb = 2, 2, 37, 16, 8

    def strided(q, k, v, lr, *rest):
        proj = torch.stack([x.transpose(1, 2) for x in (q, k, v)], 2)
        qs, ks, vs = (proj[:, :, i].transpose(1, 2) for i in range(3))
        lrs = lr.transpose(1, 2).contiguous().transpose(1, 2)
        assert qs.stride() == (n * 3 * h * d, d, 3 * h * d, 1) and lrs.stride() == (n * h, 1, h)
        return ttt_linear_bidir(qs, ks, vs, lrs, *rest, mini_batch=mb, rope_theta=10000.0, backend="triton")[0]
    _compare(strided, lambda *a: reference_bidir(*a, mb, True, 10000.0)[0], make_kernel_inputs(b, h, n, d, mb, 1),
             dtype, count_launches)


@pytest.mark.parametrize("lr_scale", [0.25, -0.25], ids=["descent", "ascent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_bidir_kernels_rates_from_logits_and_offsets(lr_scale, dtype, count_launches):
    # lr_scale / tau_offset: the kernels form lr = lr_scale * sigmoid(logit) and tau = max(0, 1 / i + offset) (one
    # position clamped at 0) and return d logit, d offset; against the reference given the formed rates
    inputs = make_kernel_inputs(1, 2, 37, 16, 8, 2)
    inputs[3] = torch.randn(1, 2, 37) * 2
    inputs[4] = torch.randn(8) * 0.1
    inputs[4][5] = -0.5

    def ref(q, k, v, logit, off, *rest):
        return reference_bidir(q, k, v, lr_scale * torch.sigmoid(logit), token_tau(off), *rest, 8)[0]
    _compare(lambda *a: ops.ttt_linear_bidir_op(*a, mini_batch=8, triton=True, lr_scale=lr_scale,
                                                tau_offset=True)[0], ref, inputs, dtype, count_launches)


@pytest.mark.parametrize("n_w0", [1, 3], ids=["shared_w0", "per_sample_w0"])
@triton_test
def test_causal_kernel(n_w0, count_launches):
    _compare(lambda *a: ttt_linear(*a, mini_batch=8, backend="triton")[0],
             lambda *a: ttt_linear_chunked(*a, 8)[0], make_kernel_inputs(3, 2, 20, 16, 8, n_w0), torch.float32,
             count_launches)


def _assert_mixer_triton_equals_naive(m, count_launches):
    """A 32-wide Vittt mixer on a 5 x 7 map (35 tokens: 2 full mini-batches of 16 and a partial one), batch 2, on the
    Triton path (one scan launch each way) and on ``torch_naive``: output and the gradients of the input and of
    every parameter."""
    x = torch.randn(2, 35, 32, device=DEV, requires_grad=True)
    params = [x] + [p for p in m.parameters()]
    outs, grads = [], []
    for backend in ("triton", "torch_naive"):
        m.backend = backend
        out = m(x, (5, 7))
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), params))
    assert count_launches["fwd"] == 1 and count_launches["bwd"] == 1
    torch.testing.assert_close(outs[0], outs[1], **KTOL[torch.float32])
    for (name, _), g, r in zip([("x", x)] + list(m.named_parameters()), *grads):
        scale = r.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g / scale, r / scale, **KTOL[torch.float32], msg=lambda s: f"d{name}: {s}")


@pytest.mark.parametrize("w0_mode,ascent", [("shared", False), ("separate", False), ("shared", True)],
                         ids=["shared", "separate", "shared_ascent"])
@triton_test
def test_mixer_triton_vs_naive_non_square(w0_mode, ascent, count_launches):
    # Vittt mixer on a 5 x 7 map (35 tokens: 2 full mini-batches of 16 and a partial one), q = k shared; on the
    # Triton path the kernels form the rate from the logits (negative scale for gradient ascent) and turn q, k
    torch.manual_seed(0)
    m = create_mixer("ttt_linear", 32, head_dim=16, w0_mode=w0_mode, base_lr=8.0, gradient_ascent=ascent).to(DEV)
    with torch.no_grad():
        m.tau_offset.normal_(std=0.1)
        m.ttt_norm_weight.normal_(1.0, 0.2)
        m.ttt_norm_bias.normal_(std=0.1)
        m.b0.normal_(std=0.05)
    _assert_mixer_triton_equals_naive(m, count_launches)


@triton_test
def test_torch_compile_fullgraph(count_launches):
    torch._dynamo.reset()
    x = [t.to(DEV).requires_grad_() for t in make_kernel_inputs(1, 1, 20, 16, 8, 2)]
    fn = torch.compile(lambda *a: ttt_linear_bidir(*a, mini_batch=8, backend="triton")[0], backend="aot_eager",
                       fullgraph=True)
    out = fn(*x)
    grads = torch.autograd.grad(out.square().sum(), x)
    assert count_launches["fwd"] >= 1 and count_launches["bwd"] >= 1
    ref = reference_bidir(*x, 8)[0]
    ref_grads = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(out, ref, **KTOL[torch.float32])
    for name, g, r in zip(NAMES, grads, ref_grads):
        scale = r.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g / scale, r / scale, **KTOL[torch.float32], msg=lambda s: f"d{name}: {s}")


@pytest.mark.parametrize("backend", ["triton", "torch", "torch_naive"])
@triton_test
def test_meta_device(backend, count_launches):
    with torch.device("meta"):
        m = create_mixer("ttt_linear", 64, head_dim=32, w0_mode="separate", backend=backend)
        x = torch.randn(2, 5 * 7, 64, requires_grad=True)
    out = m(x, (5, 7))
    assert out.device.type == "meta" and out.shape == (2, 35, 64)
    out.sum().backward()
    assert x.grad.shape == x.shape and m.w0.grad.shape == m.w0.shape and m.tau_offset.grad.device.type == "meta"
    assert count_launches["fwd"] == 0


@triton_test
def test_float64_falls_back_to_pytorch(count_launches):
    # auto falls back to PyTorch for float64; forcing the kernels raises the shared backend error
    x = [t.double() for t in make_kernel_inputs(1, 1, 10, 16, 4, 1)]
    out = ttt_linear_bidir(*x, mini_batch=4, backend="auto")[0]
    torch.testing.assert_close(out, reference_bidir(*x, 4)[0])
    assert count_launches["fwd"] == 0
    with pytest.raises(BackendError, match="float64"):
        ttt_linear_bidir(*x, mini_batch=4, backend="triton")


@triton_test
def test_inference_saves_no_states(count_launches):
    x = [t.to(DEV) for t in make_kernel_inputs(2, 1, 19, 16, 8, 2)]
    with torch.no_grad():
        out = ttt_linear_bidir(*x, mini_batch=8, backend="triton")[0]
    torch.testing.assert_close(out, reference_bidir(*x, 8)[0], **KTOL[torch.float32])
    q2, k2, w2, b2 = ops.R.bidir_inputs(x[0], x[1], x[5], x[6], 8, 10000.0)
    _, st = torch.ops.ttt_zoo.ttt_linear_scan_fwd(q2, k2, *x[2:5], w2, b2, *x[7:], 2, 8, True, 1e-6, False, True)
    assert st.numel() == 0 and count_launches["fwd"] == 2 and count_launches["bwd"] == 0


# ------------------------------------------------------------ float64 gradcheck of the causal Function and op
@pytest.mark.parametrize("n_w0", [1, 2], ids=["shared_w0", "per_sample_w0"])
def test_causal_gradcheck_tiny(n_w0):
    inputs = [t.requires_grad_() for t in make_inputs(2, 1, 5, 3, 2, n_w0)]
    assert torch.autograd.gradcheck(lambda *a: ttt_linear_torch(*a, 2)[0], inputs, fast_mode=True)  # TTTLinearScan
    assert torch.autograd.gradcheck(lambda *a: ops.ttt_linear_op(*a, 2)[0], inputs, fast_mode=True)  # the custom op


# ------------------------------------------------------------------------------------------- empty batch
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    x = [t.float().requires_grad_() for t in make_inputs(0, 2, 19, 8, 8, 1)]
    out = ttt_linear_bidir(*x, mini_batch=8, backend=backend)[0]
    assert out.shape == (0, 2, 19, 8)
    out.sum().backward()
    assert x[0].grad.shape == x[0].shape and torch.equal(x[5].grad, torch.zeros_like(x[5]))


def test_layernorm_backward_helper_takes_strided_statistics():
    # ATen's CPU LayerNorm backward reads mean/rstd as dense arrays whatever their strides; the scan's helper must
    # give the closed form for a strided slice of them (the per-mini-batch loop of the backward slices them)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 5, 4, 8, generator=g, dtype=torch.float64) * 3 + 1
    dxh = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    _, mu, rs = R._ln(z, 1e-6)
    zi, mi, ri = z[:, :, 2], mu[:, :, 2], rs[:, :, 2]
    assert not mi.is_contiguous()
    xh = (zi - zi.mean(-1, keepdim=True)) * ri
    closed = (dxh - dxh.mean(-1, keepdim=True) - xh * (dxh * xh).mean(-1, keepdim=True)) * ri
    torch.testing.assert_close(R._ln_bwd(dxh, zi, mi, ri), closed, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------ the chunk-parallel forward at the sizes TTT is sold for
LONG_N, LONG_MB = 3136, 16  # 56 x 56 tokens: 196 mini-batches, 28 chunks of 7 per direction
# the head dims of Vision-TTT and Vision-TTT-H: the kernels' launch configs (warps, stages, the dots' precision of
# 16-bit inputs) differ per head dim (triton._SM90_CFG)
LONG_DIMS = (64, 32)


def long_lr_scale(x):
    """The rate scale of a long case's inputs: 8 / head dim."""
    return 8.0 / x[0].shape[-1]


@pytest.fixture(scope="module", params=LONG_DIMS, ids=lambda d: f"d{d}")
def long_case(request):
    return _long_case(request.param)


@functools.lru_cache(maxsize=None)
def _long_case(d):
    """Bidirectional scan, batch 1, one head, N = 3136, d = 64 or 32, per-direction w0; inputs rounded to float16
    (so the fp32 and fp16 runs share them) and the float64 reference (``naive.py``, autograd) of output and
    gradients.  The output gradient is scaled so that dtau (a sum over all tokens) stays inside float16's range.  The
    rates are ``long_lr_scale * sigmoid(logit)`` and tau ``token_tau(offset)`` (some positions clamped at 0): the
    kernels take the logits and offsets (``lr_scale``, ``tau_offset``) and the reference's gradients are d/d logit,
    d/d offset."""
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    n, mb = LONG_N, LONG_MB
    x = [r(1, 1, n, d), r(1, 1, n, d), r(1, 1, n, d), r(1, 1, n),
         0.05 * r(mb),
         0.05 * r(2, 1, d, d), 0.05 * r(2, 1, 1, d), 1 + 0.2 * r(1, d), 0.1 * r(1, d)]
    x = [t.half().double() for t in x]
    do = (r(1, 1, n, d) / 64).half().double()
    leaves = [t.clone().requires_grad_() for t in x]
    rated = leaves[:3] + [long_lr_scale(x) * torch.sigmoid(leaves[3]), token_tau(leaves[4])] + leaves[5:]
    ref = ttt_linear_bidir_naive(*rated, mini_batch=mb)[0]
    return x, do, ref.detach(), torch.autograd.grad(ref, leaves, do)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)], ids=["fp32", "fp16"])
@triton_test
def test_chunk_parallel_kernels_long_sequence(long_case, dtype, tol, count_launches):
    """Forward passes 1 (states, G) and 2 (28 chunk programs per direction) and the three backward passes, with the
    in-chunk RoPE, the rates' sigmoid and tau inside the kernels, against the float64 reference:
    output and every gradient, errors relative to each tensor's largest reference entry (measured: fp32 <= 6e-7,
    fp16 <= 1e-3)."""
    x, do, ref, ref_grads = long_case
    leaves = [t.to(DEV, dtype).requires_grad_() for t in x]
    out = ops.ttt_linear_bidir_op(*leaves, mini_batch=LONG_MB, triton=True, lr_scale=long_lr_scale(x),
                                  tau_offset=True)[0]
    grads = torch.autograd.grad(out, leaves, do.to(DEV, dtype))
    assert count_launches["fwd"] == 1 and count_launches["bwd"] == 1
    for name, got, want in zip(("out",) + NAMES, (out,) + grads, (ref,) + ref_grads):
        assert got.dtype == dtype and got.shape == want.shape, name
        scale = want.abs().max().item()
        err = (got.double().cpu() - want).abs().max().item() / scale
        assert err < tol, f"{name}: max error {err:.2e} of {scale:.3g}"


@pytest.mark.parametrize("dot_loss", [False, True], ids=["mse", "dot"])
@triton_test
def test_backward_sums_inside_the_kernels(dot_loss, count_launches):
    """The float32 backward of the bidirectional op with one tensor for q = k (the mixer's case) launches the backward
    passes and one reduction and nothing else (the sums over directions, dq + dk, dW0 / db0 and the partial sums are
    in the kernels; no add after the op either); its gradients match the reference's and two runs agree bitwise
    (relaxed atomics of two addends onto 0, a fixed-order reduction)."""
    from ttt_zoo.bench.launches import count_launches as launches
    x = make_kernel_inputs(2, 2, 37, 16, 8, 1)
    x[3], x[4] = torch.randn(2, 2, 37), torch.randn(8) * 0.1  # logits and tau offsets
    leaves = [t.to(DEV).requires_grad_() for t in x[:1] + x[2:]]
    q, rest = leaves[0], leaves[1:]
    ln = (None, None) if dot_loss else tuple(rest[-2:])
    args = rest[:5] + list(ln)
    do = torch.randn(2, 2, 37, 16, device=DEV)
    runs = []
    for _ in range(2):
        out = ops.ttt_linear_bidir_op(q, q, *args, mini_batch=8, triton=True, lr_scale=0.25, tau_offset=True,
                                      dot_loss=dot_loss)[0]
        used = [q] + [t for t in args if t is not None]
        c = launches(lambda: runs.append(torch.autograd.grad(out, used, do)))
    kernels = {"_bwd_outputs": 1, "_bwd_states": 1, "_reduce_partials": 1, **({} if dot_loss else {"_bwd_keys": 1})}
    assert dict(c.triton) == kernels and c.aten_total == 0, (c.triton, c.aten)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    if dot_loss:
        from ttt_zoo.kernels.linear_attention import la_bidir_reference as ref_scan
    ref_in = [t.detach().double().requires_grad_() for t in used]
    rq, rv, rlogit, roff, rw, rb = ref_in[:6]
    rates = (rv, 0.25 * torch.sigmoid(rlogit), token_tau(roff), rw, rb)
    ref = ref_scan(rq, rq, *rates, 8) if dot_loss else reference_bidir(rq, rq, *rates, *ref_in[6:], 8)[0]
    for name, g, r in zip(("q", "v", "logit", "offset", "w0", "b0", "ln_w", "ln_b"), runs[0],
                          torch.autograd.grad(ref, ref_in, do.double())):
        scale = r.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g.double() / scale, r / scale, **KTOL[torch.float32], msg=lambda s: f"d{name}: {s}")


@pytest.fixture(scope="module")
def long_dot_case(long_case):
    return _long_dot_case(long_case[0][0].shape[-1])


@functools.lru_cache(maxsize=None)
def _long_dot_case(d):
    """``long_case``'s inputs for the dot inner loss (``linear_attention.naive``: G = -v, no inner LayerNorm) with
    gradient ascent (a negative rate scale): the float64 reference is the recurrent linear-attention scan of both
    directions (``la_bidir_reference``, autograd), d/d logit and d/d offset as above."""
    from ttt_zoo.kernels.linear_attention import la_bidir_reference
    x, do, _, _ = _long_case(d)
    leaves = [t.clone().requires_grad_() for t in x[:7]]
    q, k, v, logit, off, w0, b0 = leaves
    ref = la_bidir_reference(q, k, v, -long_lr_scale(x) * torch.sigmoid(logit), token_tau(off), w0, b0, LONG_MB)
    return x[:7], do, ref.detach(), torch.autograd.grad(ref, leaves, do)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)], ids=["fp32", "fp16"])
@triton_test
def test_dot_loss_kernels_long_sequence(long_dot_case, dtype, tol, count_launches):
    """The dot loss through the same scan kernels (``dot_loss``: forward passes 1 and 2, backward passes 1 and 2 and
    the reduction; dz = 0, so no third pass): output and the gradients of q, k, v, the logits, tau's offsets, w0 and b0 against the
    float64 recurrent reference, errors relative to each tensor's largest reference entry."""
    x, do, ref, ref_grads = long_dot_case
    leaves = [t.to(DEV, dtype).requires_grad_() for t in x]
    from ttt_zoo.bench.launches import count_launches as launches
    out = ops.ttt_linear_bidir_op(*leaves, None, None, mini_batch=LONG_MB, triton=True, lr_scale=-long_lr_scale(x),
                                  tau_offset=True, dot_loss=True)[0]
    grads = []
    bwd = launches(lambda: grads.extend(torch.autograd.grad(out, leaves, do.to(DEV, dtype))))
    assert count_launches["fwd"] == 1 and count_launches["bwd"] == 1
    assert dict(bwd.triton) == {"_bwd_outputs": 1, "_bwd_states": 1, "_reduce_partials": 1}, bwd.triton
    for name, got, want in zip(("out",) + NAMES[:7], (out,) + tuple(grads), (ref,) + ref_grads):
        assert got.dtype == dtype and got.shape == want.shape, name
        scale = want.abs().max().item()
        err = (got.double().cpu() - want).abs().max().item() / scale
        assert err < tol, f"{name}: max error {err:.2e} of {scale:.3g}"


@pytest.mark.parametrize("dot_loss", [False, True], ids=["mse", "dot"])
@triton_test
def test_long_sequence_fp16_activations_fp32_parameters(dot_loss, count_launches):
    """A mixed-precision step as the mixers run under autocast: q, k, v and the logits in fp16, the inner parameters
    (tau offsets, w0, b0, the inner LayerNorm) in fp32 as they are; the kernels read them in fp32 and their
    gradients come out fp32.  Against the float64 reference at N = 3136, d = 32 (Vision-TTT-H's head dim)."""
    x, do, ref, ref_grads = (_long_dot_case if dot_loss else _long_case)(32)
    leaves = [t.to(DEV, torch.float16 if i < 4 else torch.float32).requires_grad_() for i, t in enumerate(x)]
    scale = -long_lr_scale(x) if dot_loss else long_lr_scale(x)
    out = ops.ttt_linear_bidir_op(*leaves, *([None, None] if dot_loss else []), mini_batch=LONG_MB, triton=True,
                                  lr_scale=scale, tau_offset=True, dot_loss=dot_loss)[0]
    grads = torch.autograd.grad(out, leaves, do.to(DEV, torch.float16))
    assert count_launches["fwd"] == 1 and count_launches["bwd"] == 1
    for name, got, want, leaf in zip(("out",) + NAMES, (out,) + grads, (ref,) + ref_grads, [leaves[0]] + leaves):
        assert got.dtype == leaf.dtype and got.shape == want.shape, name
        err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
        assert err < 5e-3, f"{name}: max error {err:.2e}"


@pytest.mark.parametrize("w0_mode,ascent,steps", [("shared", False, 1), ("separate", True, 2)],
                         ids=["shared", "separate_ascent_2steps"])
@triton_test
def test_dot_loss_mixer_triton_vs_reference(w0_mode, ascent, steps, count_launches):
    """The linear-attention Vision-TTT mixer (inner_loss='dot') on the Triton path (the TTT-Linear scan kernels,
    the rate, tau and both directions inside them) against its recurrent path (``la_bidir_reference``) on a 5 x 7
    map: output and the gradients of the input and every parameter."""
    torch.manual_seed(0)
    m = create_mixer("ttt_linear", 32, head_dim=16, w0_mode=w0_mode, base_lr=8.0, inner_loss="dot",
                     gradient_ascent=ascent, inner_steps=steps).to(DEV)
    with torch.no_grad():
        m.tau_offset.normal_(std=0.1)
        m.b0.normal_(std=0.05)
    _assert_mixer_triton_equals_naive(m, count_launches)


@triton_test
def test_dot_loss_block_triton_equals_torch_path(count_launches):
    """visionttt_tiny_la's first block (64 px: a 4 x 4 map of 192 channels) on the Triton path (the scan kernels and
    the gate kernel) equals its torch path (linear attention's chunk form): output and the gradients of the
    block's input and of every parameter."""
    import timm
    from ttt_zoo.kernels.backend import use_backend
    torch.manual_seed(0)
    block = timm.create_model("visionttt_tiny_la", img_size=64).blocks[0].to(DEV)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith(("tau_offset", "b0", "lr_proj.bias")):
                p.normal_(std=0.1)
    x = torch.randn(2, 16, block.attn.dim, device=DEV, requires_grad=True)
    named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
    leaves = [x] + [p for _, p in named]
    outs, grads = [], []
    for backend in ("triton", "torch"):
        with use_backend(backend):
            out = block(x, (4, 4))
            grads.append(torch.autograd.grad(out.square().sum(), leaves))
        outs.append(out)
    assert count_launches["fwd"] == 1 and count_launches["bwd"] == 1
    torch.testing.assert_close(outs[0], outs[1], **KTOL[torch.float32])
    for name, g, r in zip(["x"] + [n for n, _ in named], *grads):
        scale = r.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g / scale, r / scale, **KTOL[torch.float32], msg=lambda s: f"d{name}: {s}")


def test_pass2_grid_grows_with_the_sequence():
    """Vision-TTT-T (3 heads of 64, bidirectional, mini-batch 16), batch 1: the two recurrences keep one program per
    sequence, the output passes (forward pass 2, backward passes 1 and 3) run one per chunk x sequence: >= 100
    programs at 2048 px (N = 128^2)."""
    if T is None:
        pytest.skip("the Triton kernels cannot run here")
    grids = {px: T.scan_grids(2, 1, 3, (px // 16) ** 2, 16) for px in (224, 1024, 2048)}
    for g in grids.values():
        assert g["_fwd_states"] == g["_bwd_states"] == (2, 3)
        assert g["_fwd_outputs"] == g["_bwd_outputs"] == g["_bwd_keys"]
    assert math.prod(grids[2048]["_fwd_outputs"]) >= 100
    assert math.prod(grids[224]["_fwd_outputs"]) < math.prod(grids[1024]["_fwd_outputs"])


# ------------------------------------------------------------ the Triton SwiGLU of the Vision-TTT MLP
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
@triton_test
def test_silu_mul_kernels_vs_float64(dtype, tol):
    """``silu_mul`` (one launch forward, one backward writing both halves of dh) and ``silu_mul_vjp`` (the same
    backward launch also writing the output) against float64 PyTorch at N = 3136 tokens (56 x 56), batch 2, hidden 520
    (Vision-TTT-T's 512 rounded: not a power of two); errors relative to each tensor's largest reference entry."""
    from ttt_zoo.kernels.ttt_linear.gate import silu_mul, silu_mul_vjp
    g = torch.Generator().manual_seed(0)
    hid = 520
    h = (torch.randn(2, 3136, 2 * hid, generator=g, dtype=torch.float64) * 3).to(dtype)
    dg = torch.randn(2, 3136, hid, generator=g, dtype=torch.float64).to(dtype)
    ref_h = h.double().requires_grad_()
    gate, value = ref_h.chunk(2, -1)
    ref = F.silu(gate) * value
    (ref_dh,) = torch.autograd.grad(ref, ref_h, dg.double())
    got_h = h.to(DEV).requires_grad_()
    out = silu_mul(got_h)
    (dh,) = torch.autograd.grad(out, got_h, dg.to(DEV))
    out2, dh2, dparams = silu_mul_vjp(h.to(DEV), dg.to(DEV))
    assert dparams == [] and torch.equal(out2, out.detach()) and torch.equal(dh2, dh)
    for name, got, want in (("out", out, ref), ("dh", dh, ref_dh)):
        assert got.dtype == dtype and got.shape == want.shape, name
        err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
        assert err < tol, f"{name}: max error {err:.2e}"


# ------------------------------------------------------------ the Triton output gate of the Vision-TTT mixer
@pytest.mark.parametrize("c", [96, 192])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
@triton_test
def test_gelu_gate_kernel_vs_float64(c, dtype, tol):
    """``gelu_gate`` (one launch forward, one + a reduction backward) against float64 PyTorch: output and the
    gradients of u (a strided split view, as the mixer's projection gives it), z, the LayerNorm weight and bias;
    errors relative to each tensor's largest reference entry."""
    from ttt_zoo.kernels.ttt_linear.gate import gelu_gate, gelu_gate_vjp
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    proj = (r(2, 37, 3 * c) * 2).to(dtype).double()
    z, w, b = (r(2, 37, c) * 3 + 1).to(dtype).double(), (1 + 0.3 * r(c)).to(dtype).double(), (0.2 * r(c)).to(dtype).double()
    dy = r(2, 37, c).to(dtype).double()
    leaves = [proj, z, w, b]
    ref_in = [t.clone().requires_grad_() for t in leaves]
    ref = F.gelu(ref_in[0][..., c:2 * c], approximate="tanh") * F.layer_norm(ref_in[1], (c,), ref_in[2], ref_in[3], 1e-6)
    ref_grads = torch.autograd.grad(ref, ref_in, dy)
    got_in = [t.to(DEV, dtype).requires_grad_() for t in leaves]
    out = gelu_gate(got_in[0][..., c:2 * c], got_in[1], got_in[2], got_in[3], 1e-6)
    grads = torch.autograd.grad(out, got_in, dy.to(DEV, dtype))
    for name, got, want in zip(("out", "u", "z", "w", "b"), (out,) + grads, (ref,) + ref_grads):
        assert got.dtype == dtype and got.shape == want.shape, name
        err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
        assert err < tol, f"{name}: max error {err:.2e}"
    # the recompute's vjp: the same backward launch, writing the output as well
    u, zwb = got_in[0][..., c:2 * c].detach(), [t.detach() for t in got_in[1:]]
    y, du, (dz, dw, db) = gelu_gate_vjp(u, dy.to(DEV, dtype), *zwb, 1e-6)
    assert torch.equal(y, out.detach()) and torch.equal(du, grads[0][..., c:2 * c])
    assert torch.equal(dz, grads[1]) and torch.equal(dw, grads[2]) and torch.equal(db, grads[3])
