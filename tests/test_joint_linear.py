"""``joint_linear``: several Linears on one input as one GEMM, against the separate ``F.linear`` calls."""
import pytest
import torch
import torch.nn.functional as F

from ttt_zoo.bench.launches import count_launches
from ttt_zoo.layers.joint_linear import joint_linear


def _layers(dtype, bias=(True, True), rows=(12, 3), cin=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, has_b in zip(rows, bias):
        w = torch.randn(r, cin, generator=g, dtype=dtype).requires_grad_()
        b = torch.randn(r, generator=g, dtype=dtype).requires_grad_() if has_b else None
        out.append((w, b))
    return out


def _separate(x, layers):
    return torch.cat([F.linear(x, w, b) for w, b in layers], -1)


@pytest.mark.parametrize("bias", [(True, True), (False, True)])
def test_gradcheck_float64(bias):
    layers = _layers(torch.float64, bias)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    params = [t for wb in layers for t in wb if t is not None]
    f = lambda x, *p: joint_linear(x, layers)  # noqa: E731  (gradcheck perturbs the same tensors in place)
    assert torch.autograd.gradcheck(f, (x, *params))
    torch.testing.assert_close(joint_linear(x, layers), _separate(x, layers), rtol=0, atol=1e-12)


@pytest.mark.parametrize("bias", [(True, True), (False, True)])
def test_fp32_values_and_grads_equal_separate_linears(bias):
    x = torch.randn(2, 196, 64)
    ours, ref = _layers(torch.float32, bias, rows=(192, 2), cin=64), _layers(torch.float32, bias, rows=(192, 2), cin=64)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(2, 196, 194)
    (joint_linear(xo, ours) * dy).sum().backward()
    (_separate(xr, ref) * dy).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad)
    for (wo, bo), (wr, br) in zip(ours, ref):
        torch.testing.assert_close(wo.grad, wr.grad)
        if bo is not None:
            torch.testing.assert_close(bo.grad, br.grad)


def test_bf16_autocast_matches_autocast_linears():
    """Under autocast the GEMM runs in bf16 as autocast's F.linear does; gradients come back in the parameters'
    float32 (compared with the float64 reference at bf16's resolution)."""
    x = torch.randn(2, 196, 64)
    layers = _layers(torch.float32, rows=(192, 2), cin=64)
    xo = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = joint_linear(xo, layers)
        ref = _separate(x, layers)
    assert y.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, rtol=0, atol=0)  # the same bf16 operands, the same GEMM
    y.float().square().sum().backward()
    x64 = x.double().requires_grad_()
    l64 = [(w.detach().double().requires_grad_(), b.detach().double().requires_grad_()) for w, b in layers]
    _separate(x64, l64).square().sum().backward()
    assert xo.grad.dtype == torch.float32 and layers[0][0].grad.dtype == torch.float32
    pairs = [(xo.grad, x64.grad)] + [(p.grad, q.grad) for wb, wb64 in zip(layers, l64) for p, q in zip(wb, wb64)]
    for got, want in pairs:
        err = (got.double() - want).norm() / want.norm()
        assert err < 2e-2, err


def test_launches():
    """2 launches forward (one cat of weights and biases, one GEMM) and 3 backward (dx, dW, db): two separate
    Linears launch 2 and 6 (their outputs' cat aside)."""
    layers = _layers(torch.float32, rows=(192, 2), cin=64)
    x = torch.randn(2, 196, 64, requires_grad=True)
    with torch.no_grad():
        assert count_launches(lambda: joint_linear(x, layers)).aten_total == 2
    y = joint_linear(x, layers)
    dy = torch.randn_like(y)
    assert count_launches(lambda: y.backward(dy)).aten_total == 3


def test_frozen_layer_gets_no_gradient():
    """A frozen layer (fine-tuning only the lr head, as linearize's param groups allow) gets none; the rest as the
    separate Linears' gradients."""
    layers, ref = _layers(torch.float32), _layers(torch.float32)
    for w, b in (layers[0], ref[0]):
        w.requires_grad_(False)
        b.requires_grad_(False)
    x = torch.randn(2, 5, 8)
    dy = torch.randn(2, 5, 15)
    (joint_linear(x, layers) * dy).sum().backward()
    (_separate(x, ref) * dy).sum().backward()
    assert layers[0][0].grad is None and layers[0][1].grad is None
    torch.testing.assert_close(layers[1][0].grad, ref[1][0].grad)
    torch.testing.assert_close(layers[1][1].grad, ref[1][1].grad)
