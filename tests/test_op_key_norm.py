"""The key instance-norm op of the T5 / DiT5 mixers (``kernels/key_norm``): every path against the reference.

torch (stores x + fp32 statistics) and the custom op against the reference in float64 and gradcheck; the Triton
kernels (under TRITON_INTERPRET=1 without a GPU) forward and backward, float32 and float16, on strided k slices;
the backend decision and an empty batch.
"""
import pytest
import torch

from _ops import BACKENDS, DEV, compare_kernel, triton_kernels, triton_test
from ttt_zoo.kernels import get_op, key_instance_norm
from ttt_zoo.kernels.key_norm import key_norm_op, key_norm_reference, key_norm_torch

KT = triton_kernels("key_norm")
KTOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=5e-3, rtol=5e-3)}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    if DEV == "cpu" and KT is not None:  # the interpreter is slow: small tiles, several programs per map
        monkeypatch.setattr(KT, "BLOCK_N", 16)
        monkeypatch.setattr(KT, "BLOCK_C", 16)


def _fwd_bwd(f, x, do):
    out = f(*x)
    return [out] + list(torch.autograd.grad(out, x, do))


def _compare_k(f_new, f_ref, inputs, dtype, names):
    compare_kernel(f_new, f_ref, inputs, dtype, names, KTOL)


def test_key_norm_paths_fp64_and_gradcheck():
    base = torch.randn(3, 13, 3 * 5, dtype=torch.float64) * 2 + 1
    x = base[..., 5:10].detach().requires_grad_()  # a strided k slice of a qkv output, as in the mixers
    dy = torch.randn(3, 13, 5, dtype=torch.float64)
    want = _fwd_bwd(lambda t: key_norm_reference(t, 0.5), [x], dy)
    for f in (key_norm_torch, key_norm_op):
        got = _fwd_bwd(lambda t: f(t, 0.5), [x], dy)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        assert torch.autograd.gradcheck(lambda t: f(t, 0.5), [x])
    # the statistics are over the N tokens, per sample and channel
    y = key_norm_torch(x, 1e-12)
    torch.testing.assert_close(y.mean(1), torch.zeros(3, 5, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close(y.var(1, unbiased=False), torch.ones(3, 5, dtype=torch.float64), atol=1e-8, rtol=0)


def test_key_norm_low_precision_stats_in_fp32():
    x = torch.randn(2, 300, 8) * 3 + 100  # large mean: fp16 statistics would cancel
    y = key_norm_torch(x.half(), 1.0)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), key_norm_reference(x.half().float(), 1.0), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("shape", [(1, 37, 40), (3, 20, 16)], ids=["B1N37C40", "B3N20C16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
@triton_test
def test_key_norm_kernels(shape, dtype):
    b, n, c = shape
    base = torch.randn(b, n, 3 * c, device=DEV) * 2 + 3
    x = base[..., c:2 * c]  # the k slice of a qkv output
    _compare_k(lambda t: KT.key_norm_triton(t, 0.5), lambda t: key_norm_reference(t, 0.5), [x], dtype, ["x"])


@triton_test
def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"\(B, N, C\)"):
        KT.key_norm_fwd_triton(torch.randn(1, 2, 8, 16, device=DEV), 1.0)


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_matches_reference(backend):
    x = (torch.randn(2, 21, 3 * 24) * 2 + 1)[..., 24:48].requires_grad_()
    dy = torch.randn(2, 21, 24)
    got = _fwd_bwd(lambda t: key_instance_norm(t, 0.5, backend=backend), [x], dy)
    want = _fwd_bwd(lambda t: key_norm_reference(t, 0.5), [x], dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert get_op("key_instance_norm", torch.device("cpu"), "torch_naive") is key_norm_reference


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    x = torch.randn(0, 9, 8, requires_grad=True)
    y = key_instance_norm(x, 1.0, backend=backend)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
