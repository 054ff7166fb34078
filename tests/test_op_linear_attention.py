"""The linear-attention Vision-TTT scan: recurrent (naive) vs chunk-parallel (torch) vs Triton (interpreter), and
both against a per-token autograd inner loop (tests/_ops.py: explicit dot-product loss, torch.autograd.grad)."""
import pytest
import torch

from _ops import DEV, autograd_dot_scan, triton_test
from ttt_zoo.kernels import linear_attention_bidir
from ttt_zoo.kernels.linear_attention import la_chunk_torch, la_scan_naive, linear_attention_op

DT = torch.float64


def _inputs(b=2, h=2, n=37, d=8, mb=16, dtype=DT, nw=1):
    g = torch.Generator().manual_seed(n * 31 + d)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=DT) for _ in range(3))
    lr = torch.rand(b, h, n, generator=g, dtype=DT) * 0.05
    tau = torch.rand(mb, generator=g, dtype=DT) + 0.1
    w0 = torch.randn(nw, h, d, d, generator=g, dtype=DT) * 0.1
    b0 = torch.randn(nw, h, 1, d, generator=g, dtype=DT) * 0.1
    return [t.to(dtype) for t in (q, k, v, lr, tau, w0, b0)]


@pytest.mark.parametrize("n,mb", [(37, 16), (5, 8), (64, 16), (33, 4)])
def test_recurrent_and_chunk_vs_autograd_inner_loop(n, mb):
    args = _inputs(n=n, mb=mb)
    ref = autograd_dot_scan(*args, mb)
    torch.testing.assert_close(la_scan_naive(*args, mb), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(la_chunk_torch(*args, mb), ref, rtol=1e-10, atol=1e-10)
    # the inclusive mask matters: an exclusive one (token i without its own update) is far off
    q, k, v, lr, tau, w0, b0 = args
    assert (la_scan_naive(q, k, v, lr, tau, w0, b0, mb) - la_scan_naive(q, k, v * 0, lr, tau, w0, b0, mb)).abs().max() > 1e-3
    excl = ref - (tau[torch.arange(n) % mb, None] * lr[..., None] * ((q * k).sum(-1, keepdim=True) + 1)) * v
    assert (excl - ref).abs().max() > 1e-3


@pytest.mark.parametrize("nw", [1, 2])
def test_bidir_56x56_recurrent_equals_chunk_parallel(nw):
    """Both directions at 56 x 56 = 3136 tokens (Vision-TTT-H stage 0), shared or per-direction W0, in-chunk RoPE."""
    q, k, v, lr, tau, w0, b0 = _inputs(b=1, h=2, n=3136, d=8, nw=nw)
    rec = linear_attention_bidir(q, q, v, lr, tau, w0, b0, 16, 10000.0, backend="torch_naive")
    par = linear_attention_bidir(q, q, v, lr, tau, w0, b0, 16, 10000.0, backend="torch")
    assert (rec - par).abs().max().item() < 1e-10 * max(1.0, rec.abs().max().item())
    # the backward direction matters: a forward-only scan differs
    fwd_only = la_scan_naive(q, q, v, lr, tau, w0[:1], b0[:1], 16)
    assert (rec - fwd_only).abs().max() > 1e-3


@pytest.mark.parametrize("n,mb", [(37, 16), (200, 16)])
def test_chunk_backward_matches_recurrent(n, mb):
    args = [t.requires_grad_() for t in _inputs(n=n, mb=mb)]
    do = torch.randn(2, 2, n, 8, dtype=DT)
    g1 = torch.autograd.grad(la_scan_naive(*args, mb), args, do)
    g2 = torch.autograd.grad(la_chunk_torch(*args, mb), args, do)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    small = [t.detach()[:1, :1].clone().requires_grad_() if t.dim() == 4 else t.detach().clone().requires_grad_()
             for t in _inputs(b=1, h=1, n=11, d=3, mb=4)]
    small[3] = small[3].detach()[:1, :1].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda *t: linear_attention_op(*t, 4), small)


@pytest.mark.triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("n,mb,d", [(37, 16, 8), (70, 8, 64), (16, 16, 32)])
def test_triton_forward_and_backward(dtype, tol, n, mb, d):
    pytest.importorskip("triton")
    args = _inputs(b=2, h=3, n=n, d=d, mb=mb)
    ref = la_scan_naive(*args, mb)
    low = [t.to(dtype).requires_grad_() for t in args]
    out = linear_attention_op(*low, mb)
    assert out.dtype == dtype
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() < tol * scale
    do = torch.randn_like(ref)
    g = torch.autograd.grad(out, low, do.to(dtype))
    ins = [t.detach().requires_grad_() for t in args]
    g_ref = torch.autograd.grad(la_scan_naive(*ins, mb), ins, do)
    for a, b in zip(g, g_ref):
        assert (a.double() - b).abs().max().item() < tol * max(1.0, b.abs().max().item()) * 4


# ------------------------------------------------------------ linear_attention_bidir (the LA forms' op, bidir.py)
def _bidir_inputs(n, d, dtype=DT, nw=2):
    """The mixer's call: q = k one tensor, lr as logits, tau as offsets, w0 / b0 one per direction."""
    q, _, v, _, _, w0, b0 = _inputs(b=1, h=1, n=n, d=d, nw=nw)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 1, n, generator=g, dtype=DT)
    offsets = torch.randn(16, generator=g, dtype=DT) * 0.1
    return [t.to(dtype) for t in (q, v, logits, offsets, w0, b0)]


def test_bidir_op_paths_form_rates_from_logits_and_offsets():
    """The registered op's torch and torch_naive paths with logits / offsets (a negative scale: gradient ascent)
    equal the recurrent reference on rates formed by hand, float64."""
    from ttt_zoo.kernels import get_op
    from ttt_zoo.kernels.linear_attention import la_bidir_reference
    from ttt_zoo.kernels.ttt_linear import token_tau
    q, v, logits, offsets, w0, b0 = _bidir_inputs(77, 8)
    ref = la_bidir_reference(q, q, v, -0.3 * torch.sigmoid(logits), token_tau(offsets), w0, b0, 16, 10000.0)
    for path in ("torch", "torch_naive"):
        out = get_op("linear_attention_bidir", q.device, path)(q, q, v, logits, offsets, w0, b0, 16, 10000.0, -0.3,
                                                              True)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10, msg=path)
    plain = get_op("linear_attention_bidir", q.device, "torch")(q, q, v, logits, offsets, w0, b0, 16, 10000.0)
    assert (plain - ref).abs().max() > 1e-2  # lr_scale = 0, tau_offset off: the raw numbers are the rates


@triton_test
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)], ids=["fp32", "fp16"])
def test_bidir_op_triton_path_vs_float64_reference(dtype, tol):
    """The op's Triton path (the TTT-Linear scan kernels with the dot loss) at N = 3136, the mixer's call (q = k,
    logits, offsets, per-direction state, ascent), forward and every gradient against the float64 recurrent
    reference, errors relative to each tensor's largest reference entry."""
    from ttt_zoo.kernels import get_op
    x = _bidir_inputs(3136, 16)
    do = torch.randn(1, 1, 3136, 16, generator=torch.Generator().manual_seed(3), dtype=DT)
    ref_in = [t.clone().requires_grad_() for t in x]
    q, v, logits, offsets, w0, b0 = ref_in
    ref = get_op("linear_attention_bidir", q.device, "torch_naive")(q, q, v, logits, offsets, w0, b0, 16, 10000.0,
                                                                    -0.05, True)
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    low = [t.to(DEV, dtype if i < 3 else torch.float32).requires_grad_() for i, t in enumerate(x)]  # state fp32
    q, v, logits, offsets, w0, b0 = low
    out = get_op("linear_attention_bidir", q.device, "triton")(q, q, v, logits, offsets, w0, b0, 16, 10000.0,
                                                               -0.05, True)
    grads = torch.autograd.grad(out, low, do.to(DEV, dtype))
    for name, got, want in zip(("out", "q", "v", "logits", "offsets", "w0", "b0"), (out,) + grads,
                               (ref,) + ref_grads):
        assert got.shape == want.shape, name
        err = (got.double().cpu() - want).abs().max().item() / want.abs().max().item()
        assert err < tol, f"{name}: max error {err:.2e}"
