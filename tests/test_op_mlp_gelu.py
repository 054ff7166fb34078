"""The MLP's GELU recomputed in the backward (``kernels/mlp_gelu``): gelu(h) and dg gelu'(h) from one launch.

The PyTorch path and the custom op against the float64 reference; the Triton kernel (under TRITON_INTERPRET=1
without a GPU) in float32 and float16, both GELU forms, on a DiT-S MLP's hidden activation at N = 3136 tokens; its
one launch; a ``TokenMlp`` training step on the kernel equal to autograd's, one launch fewer; bad input.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _ops import DEV, triton_test
from ttt_zoo.bench.launches import count_launches
from ttt_zoo.kernels.backend import use_backend
from ttt_zoo.kernels.mlp_gelu import gelu_vjp_op, gelu_vjp_reference, gelu_vjp_torch, triton_path
from ttt_zoo.layers import TokenMlp

FORMS = ["none", "tanh"]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(shape, generator=g) * 2 + 0.3  # an fc1 output: both tails of the GELU reached
    dg = torch.randn(shape, generator=g)
    return h.to(DEV, dtype), dg.to(DEV, dtype)


@pytest.mark.parametrize("approximate", FORMS)
def test_torch_path_and_op_match_float64_reference(approximate):
    h, dg = _inputs((3, 17, 24), torch.float64)
    want = gelu_vjp_reference(h, dg, approximate)
    h_ = h.detach().requires_grad_()
    (auto,) = torch.autograd.grad(F.gelu(h_, approximate=approximate), h_, dg)
    torch.testing.assert_close(want[1], auto, rtol=1e-12, atol=1e-12)  # the reference is autograd's gradient
    for got in (gelu_vjp_torch(h, dg, approximate), gelu_vjp_op(h, dg, approximate, triton=False)):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@triton_test
@pytest.mark.parametrize("approximate", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_against_float64(approximate, dtype):
    h, dg = _inputs((2, 3136, 384), dtype)  # a DiT-S/2 MLP's hidden activation at 112 x 112 tokens (4C / 4)
    g, dh = gelu_vjp_op(h, dg, approximate, triton=True)
    assert g.dtype == dh.dtype == dtype and g.is_contiguous()
    want_g, want_dh = gelu_vjp_reference(h.double(), dg.double(), approximate)
    tol = 2e-6 if dtype == torch.float32 else 1e-3  # of each tensor's largest entry (fp16: its rounding)
    for got, want in ((g, want_g), (dh, want_dh)):
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < tol, (approximate, dtype, err.item())


@triton_test
def test_triton_kernel_is_one_launch_and_takes_odd_sizes():
    h, dg = _inputs((5, 7, 13), torch.float32)  # 455 elements: a masked tail
    c = count_launches(lambda: gelu_vjp_op(h, dg, "tanh", triton=True))
    assert c.triton_total == 1 and c.aten_total == 0, (c.triton, c.aten)
    for a, b in zip(gelu_vjp_op(h, dg, "tanh", triton=True), gelu_vjp_reference(h, dg, "tanh")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@triton_test
@pytest.mark.parametrize("approximate", FORMS)
def test_token_mlp_training_step_on_the_kernel(approximate):
    """TokenMlp's recomputing backward with the kernel as its ``mid_vjp``: the gradients of autograd's path, and one
    launch fewer (``gelu`` + ``gelu_backward`` -> one kernel)."""
    torch.manual_seed(0)
    mlp = TokenMlp(48, 192, act_layer=lambda: nn.GELU(approximate=approximate)).to(DEV)
    x = torch.randn(2, 100, 48, device=DEV, requires_grad=True)
    w = torch.randn(2, 100, 48, device=DEV)
    grads, launches = [], []
    for backend in ("torch", "triton"):
        def step():
            mlp.zero_grad(set_to_none=True)
            x.grad = None
            with use_backend(backend):
                (mlp(x, (10, 10)) * w).sum().backward()
        step()
        launches.append(count_launches(step).total)
        grads.append([x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert launches[1] == launches[0] - 1, launches


def test_triton_path_is_none_on_the_torch_backend_and_bad_input_says_why():
    h, dg = _inputs((2, 3, 4), torch.float32)
    assert triton_path(h, "torch", "none") is None
    with pytest.raises(ValueError, match="approximate must be one of"):
        gelu_vjp_op(h, dg, "erf")
    with pytest.raises(ValueError, match="one shape"):
        gelu_vjp_op(h, dg[:1], "none")
