"""The recomputing PyTorch TTT-Linear scan (analytic backward) vs. autograd of the reference, in float64.

Also: gradcheck of the analytic backward on tiny shapes, the custom ops' schema / fake kernels (opcheck) and the
dispatch table (torch = recomputing path, torch_naive = reference).
"""
import pytest
import torch

from ttt_zoo.kernels import get_op, ttt_linear_bidir, ttt_linear_reference
from ttt_zoo.kernels.ttt_linear import ops
from ttt_zoo.kernels.ttt_linear import torch as R
from ttt_zoo.kernels.ttt_linear.naive import ttt_linear_bidir as reference_bidir

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
        ref = lambda *a: ttt_linear_reference(*a, mb, ln_res)[0]  # noqa: E731
    inputs = make_inputs(b, h, n, d, mb, nw)
    for shared_qk in (False, True):
        out, gs, do = grads_of(new, inputs, shared_qk=shared_qk)
        rout, rgs, _ = grads_of(ref, inputs, do, shared_qk=shared_qk)
        torch.testing.assert_close(out, rout, atol=1e-12, rtol=1e-10)
        for name, g, r in zip(NAMES, gs, rgs):
            torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("ln_res", [True, False], ids=["ln", "plain"])
def test_gradcheck_tiny(ln_res):
    inputs = [t.requires_grad_() for t in make_inputs(1, 1, 5, 4, 2, 2)]
    assert torch.autograd.gradcheck(lambda *a: R.ttt_linear_bidir_torch(*a, 2, ln_res, 10000.0)[0], inputs,
                                    fast_mode=True)
    # the custom ops' PyTorch kernel (float64 never takes the Triton path)
    assert torch.autograd.gradcheck(lambda *a: ops.ttt_linear_bidir_op(*a, 2, ln_res, None)[0], inputs,
                                    fast_mode=True)


def test_opcheck_fake_kernels():
    x = make_inputs(2, 1, 23, 4, 4, 1, torch.float32)
    q2, k2, w2, b2 = R.bidir_inputs(x[0], x[1], x[5], x[6], 4, 10000.0)
    args = [q2, k2, x[2], x[3], x[4], w2, b2, x[7], x[8], 2, 4, True, 1e-6]
    torch.library.opcheck(torch.ops.ttt_zoo.ttt_linear_scan_fwd.default, args + [True],
                          test_utils=("test_schema", "test_faketensor"))
    out, st = torch.ops.ttt_zoo.ttt_linear_scan_fwd(*args, True)
    # 6 mini-batches, a checkpoint every ceil(sqrt(6)) = 3: (ndir B, heads, 2, d + 1, d)
    assert st.shape == (4, 1, 2, 5, 4) and R.ckpt_every(6) == 3
    torch.library.opcheck(torch.ops.ttt_zoo.ttt_linear_scan_bwd.default, [torch.randn_like(out)] + args[:9] + [st]
                          + args[9:], test_utils=("test_schema", "test_faketensor"))


def test_dispatch_table():
    cpu = torch.device("cpu")
    assert get_op("ttt_linear", cpu) is R.ttt_linear_torch
    assert get_op("ttt_linear", cpu, "torch_naive") is ttt_linear_reference
    assert get_op("ttt_linear_bidir", cpu) is R.ttt_linear_bidir_torch
    assert get_op("ttt_linear_bidir", torch.device("meta")) is R.ttt_linear_bidir_torch
    assert get_op("ttt_linear_bidir", cpu, "torch_naive") is R.ttt_linear_bidir_naive
    if ops.HAS_TRITON:
        assert get_op("ttt_linear_bidir", cpu, "triton") is ops.ttt_linear_bidir_op


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
    from ttt_zoo.kernels.ttt_linear.torch import ttt_linear_torch
    from ttt_zoo.kernels.ttt_linear.naive import token_tau, ttt_linear_reference
    b, h, n, d = 1, 2, 20, 8
    q, k, v = [torch.randn(b, h, n, d) for _ in range(3)]
    lr = torch.rand(b, h, n) * 0.1
    tau = token_tau(torch.zeros(8))
    w0, b0 = torch.randn(1, h, d, d) * 0.1, torch.zeros(1, h, 1, d)
    ln_w, ln_b = torch.ones(h, d), torch.zeros(h, d)
    with torch.no_grad():
        out, gn = ttt_linear_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, 8)
        ref, _ = ttt_linear_reference(q, k, v, lr, tau, w0, b0, ln_w, ln_b, 8)
        _, gn2 = ttt_linear_torch(q, k, v, lr, tau, w0, b0, ln_w, ln_b, 8, return_grad_norm=True)
    assert gn is None and gn2.shape == (b, h, n)
    torch.testing.assert_close(out, ref)
