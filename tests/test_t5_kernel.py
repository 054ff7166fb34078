"""The T5 inner step against autograd of its stated inner loss (independent of the closed-form gradients)."""
import pytest
import torch
import torch.nn.functional as F

from ttt_zoo.kernels import get_op, t5_swiglu_ttt
from ttt_zoo.kernels.inner_mlp import t5_swiglu_ttt_reference


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


def _inputs(b=2, heads=2, n=12, d=8, dtype=torch.float64, std=0.5):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, heads, n, d, generator=g, dtype=dtype) for _ in range(3))
    w1, w2, w3 = (torch.randn(1, heads, d, d, generator=g, dtype=dtype) * std for _ in range(3))
    return q, k, v, w1, w2, w3


def test_matches_autograd_of_inner_loss():
    q, k, v, w1, w2, w3 = _inputs()
    scale = 8 ** -0.5
    out = t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, scale)
    ref = _autograd_step(q, k, v, w1, w2, w3, scale)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # the step matters: without it the output differs
    assert not torch.allclose(out, _f(q, w1, w2, w3), atol=1e-3)


def test_samples_do_not_mix():
    q, k, v, w1, w2, w3 = _inputs()
    out = t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, 0.3)
    single = t5_swiglu_ttt_reference(q[1:], k[1:], v[1:], w1, w2, w3, 0.3)
    torch.testing.assert_close(out[1:], single, rtol=1e-13, atol=1e-13)


def test_gradients_flow_through_update():
    q, k, v, w1, w2, w3 = _inputs(b=1, heads=1, n=5, d=3)
    args = [t.requires_grad_(True) for t in (q, k, v, w1, w2, w3)]
    assert torch.autograd.gradcheck(lambda *a: t5_swiglu_ttt_reference(*a, 0.7), args)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_fp32(dtype):
    q, k, v, w1, w2, w3 = _inputs(n=64, dtype=torch.float32, std=0.2)
    low = [t.to(dtype) for t in (q, k, v, w1, w2, w3)]
    out = t5_swiglu_ttt_reference(*low, 8 ** -0.5)
    assert out.dtype == dtype
    # identical to running the float32 op on the rounded inputs, then rounding once
    ref32 = t5_swiglu_ttt_reference(*[t.float() for t in low], 8 ** -0.5)
    torch.testing.assert_close(out, ref32.to(dtype), rtol=0, atol=0)


def test_dispatch_registers_reference():
    # the plain reference is the torch_naive backend; the default CPU path (recomputing backward) matches it
    assert get_op("t5_swiglu_ttt", torch.device("cpu"), "torch_naive") is t5_swiglu_ttt_reference
    q, k, v, w1, w2, w3 = _inputs()
    torch.testing.assert_close(t5_swiglu_ttt(q, k, v, w1, w2, w3, 0.5),
                               t5_swiglu_ttt_reference(q, k, v, w1, w2, w3, 0.5), rtol=1e-12, atol=1e-12)
