"""Triton TTT-Linear scan kernels vs. the PyTorch reference (under TRITON_INTERPRET=1 without a GPU).

Forward output and every input/weight gradient (q, k, v, lr, tau, w0, b0, ln_w, ln_b) through the public
``ttt_zoo.kernels`` entry points with ``backend='triton'``; tight in float32, looser in float16 (bf16 is not tested:
the interpreter's bf16 arithmetic is wrong).  Shapes cover N % mini_batch != 0, H != W at the mixer level, head dims
32/64/72 (padded to 32/64/128), batch 1 and 3, shared / per-direction w0, with and without the LN + residual inner
model and in-chunk RoPE; torch.compile over the op and the meta device.
"""
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set (tests/conftest.py sets it before triton is imported)",
                allow_module_level=True)

from ttt_zoo.kernels import ttt_linear, ttt_linear_bidir  # noqa: E402
from ttt_zoo.kernels.ttt_linear import ops  # noqa: E402
from ttt_zoo.kernels.ttt_linear import triton as T  # noqa: E402
from ttt_zoo.kernels.ttt_linear.naive import ttt_linear_bidir as reference_bidir  # noqa: E402
from ttt_zoo.kernels.ttt_linear.naive import ttt_linear_reference  # noqa: E402
from ttt_zoo.layers import create_mixer  # noqa: E402

pytestmark = pytest.mark.triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}
NAMES = ("q", "k", "v", "lr", "tau", "w0", "b0", "ln_w", "ln_b")


@pytest.fixture(autouse=True)
def count_launches(monkeypatch):
    """Make sure the Triton kernels (not the PyTorch fallback) really ran."""
    monkeypatch.setattr(ops, "MAX_D", 128)  # on a GPU, also run the d = 72 case through the kernels
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


def make_inputs(b, h, n, d, mb, n_w0):
    return [torch.randn(b, h, n, d), torch.randn(b, h, n, d), torch.randn(b, h, n, d), torch.rand(b, h, n) * 0.3,
            torch.rand(mb) + 0.2, torch.randn(n_w0, h, d, d) * 0.1, torch.randn(n_w0, h, 1, d) * 0.1,
            torch.randn(h, d) * 0.3 + 1.0, torch.randn(h, d) * 0.1]


def _compare(f_new, f_ref, inputs, dtype, calls):
    """Forward and all gradients; the reference runs in float32 on float32 copies of the same low-precision data."""
    leaves = [t.to(DEV, dtype).requires_grad_() for t in inputs]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    out = f_new(*leaves)
    ref = f_ref(*ref_leaves)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, do.to(dtype), allow_unused=True)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do, allow_unused=True)
    assert calls["fwd"] == 1 and calls["bwd"] == 1
    for name, x, g, r in zip(NAMES, leaves, grads, ref_grads):
        r = torch.zeros_like(x, dtype=torch.float32) if r is None else r
        assert g is not None and g.dtype == dtype and g.shape == x.shape, name
        scale = r.abs().max().clamp_min(1e-6)  # compare relative to the gradient's magnitude
        torch.testing.assert_close(g.float() / scale, r / scale, **TOL[dtype], msg=lambda m: f"d{name}: {m}")


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
def test_bidir_kernels(case, dtype, count_launches):
    b, h, n, d, mb, nw, ln_res, rope = case
    if dtype == torch.float16 and d >= 64:
        pytest.skip("covered in fp32; keeps the interpreter run short")
    theta = 10000.0 if rope else None
    _compare(lambda *a: ttt_linear_bidir(*a, mini_batch=mb, ln_residual=ln_res, rope_theta=theta,
                                         backend="triton")[0],
             lambda *a: reference_bidir(*a, mb, ln_res, theta)[0], make_inputs(b, h, n, d, mb, nw), dtype,
             count_launches)


@pytest.mark.parametrize("n_w0", [1, 3], ids=["shared_w0", "per_sample_w0"])
def test_causal_kernel(n_w0, count_launches):
    _compare(lambda *a: ttt_linear(*a, mini_batch=8, backend="triton")[0],
             lambda *a: ttt_linear_reference(*a, 8)[0], make_inputs(3, 2, 20, 16, 8, n_w0), torch.float32,
             count_launches)


@pytest.mark.parametrize("w0_mode", ["shared", "separate"])
def test_mixer_triton_vs_naive_non_square(w0_mode, count_launches):
    # Vittt mixer on a 5 x 7 map (35 tokens: 2 full mini-batches of 16 and a partial one), q = k shared
    torch.manual_seed(0)
    m = create_mixer("ttt_linear", 32, head_dim=16, w0_mode=w0_mode, base_lr=8.0).to(DEV)
    with torch.no_grad():
        m.tau_offset.normal_(std=0.1)
        m.ttt_norm_weight.normal_(1.0, 0.2)
        m.ttt_norm_bias.normal_(std=0.1)
        m.b0.normal_(std=0.05)
    x = torch.randn(2, 35, 32, device=DEV, requires_grad=True)
    params = [x] + [p for p in m.parameters()]
    outs, grads = [], []
    for backend in ("triton", "torch_naive"):
        m.backend = backend
        out = m(x, (5, 7))
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), params))
    assert count_launches["fwd"] == 1 and count_launches["bwd"] == 1
    torch.testing.assert_close(outs[0], outs[1], **TOL[torch.float32])
    for (name, _), g, r in zip([("x", x)] + list(m.named_parameters()), *grads):
        scale = r.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g / scale, r / scale, **TOL[torch.float32], msg=lambda s: f"d{name}: {s}")


def test_torch_compile_fullgraph(count_launches):
    torch._dynamo.reset()
    x = [t.requires_grad_() for t in make_inputs(1, 1, 20, 16, 8, 2)]
    fn = torch.compile(lambda *a: ttt_linear_bidir(*a, mini_batch=8, backend="triton")[0], backend="aot_eager",
                       fullgraph=True)
    out = fn(*x)
    grads = torch.autograd.grad(out.square().sum(), x)
    assert count_launches["fwd"] >= 1 and count_launches["bwd"] >= 1
    ref = reference_bidir(*x, 8)[0]
    ref_grads = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    for name, g, r in zip(NAMES, grads, ref_grads):
        scale = r.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g / scale, r / scale, **TOL[torch.float32], msg=lambda s: f"d{name}: {s}")


@pytest.mark.parametrize("backend", ["triton", "torch", "torch_naive"])
def test_meta_device(backend, count_launches):
    with torch.device("meta"):
        m = create_mixer("ttt_linear", 64, head_dim=32, w0_mode="separate", backend=backend)
        x = torch.randn(2, 5 * 7, 64, requires_grad=True)
    out = m(x, (5, 7))
    assert out.device.type == "meta" and out.shape == (2, 35, 64)
    out.sum().backward()
    assert x.grad.shape == x.shape and m.w0.grad.shape == m.w0.shape and m.tau_offset.grad.device.type == "meta"
    assert count_launches["fwd"] == 0


def test_float64_falls_back_to_pytorch(count_launches):
    x = [t.double() for t in make_inputs(1, 1, 10, 16, 4, 1)]
    out = ttt_linear_bidir(*x, mini_batch=4, backend="triton")[0]
    torch.testing.assert_close(out, reference_bidir(*x, 4)[0])
    assert count_launches["fwd"] == 0


def test_inference_saves_no_states(count_launches):
    x = [t.to(DEV) for t in make_inputs(2, 1, 19, 16, 8, 2)]
    with torch.no_grad():
        out = ttt_linear_bidir(*x, mini_batch=8, backend="triton")[0]
    torch.testing.assert_close(out, reference_bidir(*x, 8)[0], **TOL[torch.float32])
    q2, k2, w2, b2 = ops.R.bidir_inputs(x[0], x[1], x[5], x[6], 8, 10000.0)
    _, st = torch.ops.ttt_zoo.ttt_linear_scan_fwd(q2, k2, *x[2:5], w2, b2, *x[7:], 2, 8, True, 1e-6, False)
    assert st.numel() == 0 and count_launches["fwd"] == 2 and count_launches["bwd"] == 0
