"""The residual depthwise 3x3 conv op (``kernels/dwconv``): ``act(x + dwconv3x3(x))`` on (B, N, C) tokens, the blocks'
CPE and H-ViT3's MLP conv.

The PyTorch path and the custom op against the float64 reference (nine shifted slices, no conv op) and gradcheck; the
Triton kernels in the interpreter (or on a GPU) in fp32 and fp16 at N in the thousands, square and non-square maps,
forward and every gradient, act None and GELU; the backward's fixed-order reduction; int64 offsets past 2^31; the
layers' choice (Triton only in eager, the aten conv while tracing) and the blocks on the Triton path against PyTorch.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from timm.layers import set_layer_config

from _ops import DEV, TRITON_OK, triton_kernels, triton_test
from ttt_zoo.kernels import residual_dwconv3x3, use_backend
from ttt_zoo.kernels.dwconv import (residual_dwconv_op, residual_dwconv_reference, residual_dwconv_torch,
                                    residual_dwconv_vjp, triton_path)

DT = triton_kernels("dwconv")


def _inputs(b, h, w, c, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h * w, c, generator=g, dtype=dtype)
    weight = torch.randn(c, 1, 3, 3, generator=g, dtype=dtype) * 0.3
    bias = torch.randn(c, generator=g, dtype=dtype) * 0.1
    return x, weight, bias


def _fwd_bwd(f, leaves, dy):
    out = f(*leaves)
    return [out] + list(torch.autograd.grad(out, leaves, dy))


@pytest.mark.parametrize("act", [None, "gelu"])
def test_torch_path_and_custom_op_match_the_reference_fp64(act):
    x, w, b = (t.requires_grad_() for t in _inputs(2, 5, 7, 6))
    dy = torch.randn(2, 35, 6, dtype=torch.float64)
    want = _fwd_bwd(lambda *t: residual_dwconv_reference(*t, (5, 7), act), [x, w, b], dy)
    # the reference against a plain NCHW conv: same padding, cross-correlation orientation, residual, bias
    conv = F.conv2d(x.detach().transpose(1, 2).reshape(2, 6, 5, 7), w.detach(), b.detach(), padding=1, groups=6)
    plain = x.detach() + conv.flatten(2).transpose(1, 2)
    torch.testing.assert_close(want[0].detach(), F.gelu(plain) if act else plain, rtol=1e-12, atol=1e-12)
    for f in (residual_dwconv_torch, lambda *t: residual_dwconv_op(*t, triton=False)):
        got = _fwd_bwd(lambda *t: f(*t, (5, 7), act), [x, w, b], dy)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("act", [None, "gelu"])
def test_gradcheck_fp64(act):
    x, w, b = (t.requires_grad_() for t in _inputs(1, 3, 4, 3, seed=1))
    for f in (residual_dwconv_torch, residual_dwconv_reference, lambda *t: residual_dwconv_op(*t, triton=False)):
        assert torch.autograd.gradcheck(lambda *t: f(*t, (3, 4), act), [x, w, b])


_ON_TRITON = pytest.param(True, marks=[pytest.mark.triton, pytest.mark.skipif(not TRITON_OK, reason="no Triton")])


@pytest.mark.parametrize("triton", [False, _ON_TRITON], ids=["torch", "triton"])
@pytest.mark.parametrize("act, pre", [(None, False), ("gelu", False), ("gelu", True)], ids=["none", "gelu", "gelu_pre"])
def test_vjp_gives_the_output_and_the_gradients(act, pre, triton):
    """``residual_dwconv_vjp`` (the MLP's recomputing backward): y and (dx, dW, db) of one backward, as the forward
    and autograd give them (float64 on the PyTorch branch, float32 in the kernels); with ``pre_x`` (x = gelu(h))
    the gradient of h."""
    dtype = torch.float32 if triton else torch.float64
    h, w, b = (t.to(dtype).to(DEV if triton else "cpu").requires_grad_() for t in _inputs(2, 6, 11, 20, seed=5))
    dy = torch.randn_like(h)
    first = F.gelu if pre else (lambda t: t)
    want = _fwd_bwd(lambda h_, *t: residual_dwconv_reference(first(h_), *t, (6, 11), act), [h, w, b], dy)
    got = residual_dwconv_vjp(dy, first(h.detach()), w.detach(), b.detach(), (6, 11), act,
                              pre_x=h.detach() if pre else None, triton=triton)
    tol = dict(rtol=1e-5, atol=1e-5) if triton else dict(rtol=1e-10, atol=1e-10)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r.detach(), **tol)


def test_bad_arguments_say_what_is_wrong():
    x, w, b = _inputs(1, 3, 4, 3)
    with pytest.raises(ValueError, match="feat_size"):
        residual_dwconv3x3(x, w, b, (4, 4))
    with pytest.raises(ValueError, match="act must be one of"):
        residual_dwconv3x3(x, w, b, (3, 4), act="relu")
    with pytest.raises(ValueError, match=r"depthwise weight \(3, 1, 3, 3\)"):
        residual_dwconv3x3(x, w[:2], b, (3, 4))


def test_empty_batch_and_meta():
    x, w, b = _inputs(0, 3, 4, 5, torch.float32)
    assert residual_dwconv_op(x, w.float(), b.float(), (3, 4), "gelu", triton=True).shape == (0, 12, 5)
    m = torch.empty(2, 12, 5, device="meta")
    assert residual_dwconv_op(m, w.to("meta"), b.to("meta"), (3, 4), None, triton=True).shape == (2, 12, 5)


# ------------------------------------------------------------------------------------------- the Triton kernels
KTOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _check_kernel(shape, dtype, act, seed=0):
    """Forward, dx, dweight, dbias of the kernels in ``dtype`` against the float64 reference on the same (rounded)
    data; each relative to its largest magnitude.  Weights stay float32 (as the layers keep them)."""
    b, h, w, c = shape
    x64, w64, b64 = _inputs(b, h, w, c, seed=seed)
    x = x64.to(dtype).to(DEV).requires_grad_()
    weight, bias = (t.float().to(DEV).requires_grad_() for t in (w64, b64))
    dy = torch.randn(b, h * w, c, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    out = residual_dwconv_op(x, weight, bias, (h, w), act, triton=True)
    got = [out] + list(torch.autograd.grad(out, (x, weight, bias), dy.to(dtype).to(DEV)))
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (x, weight, bias)]
    want = _fwd_bwd(lambda *t: residual_dwconv_reference(*t, (h, w), act), ref_leaves, dy.to(dtype).double())
    assert [g.dtype for g in got] == [dtype, dtype, torch.float32, torch.float32]
    for name, g, r in zip(("y", "dx", "dweight", "dbias"), got, want):
        scale = r.abs().max()
        torch.testing.assert_close(g.cpu().double() / scale, r / scale, **KTOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(1, 48, 48, 64), (1, 40, 72, 64)], ids=["48x48", "40x72"])
@triton_test
def test_kernels_gelu_match_the_fp64_reference(shape, dtype):
    _check_kernel(shape, dtype, "gelu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(1, 56, 56, 64), (2, 40, 72, 96)], ids=["56x56", "B2_40x72_C96"])
@triton_test
def test_kernels_no_act_match_the_fp64_reference(shape, dtype):
    _check_kernel(shape, dtype, None)


@triton_test
def test_kernels_odd_map_channel_tail_and_chunked_backward(monkeypatch):
    """C = 40 (a masked channel tail), a 7 x 9 map, and the backward's programs walking several token tiles each
    (few target programs): the partial sums still add up; the reduction is in fixed order (bitwise repeatable)."""
    monkeypatch.setattr(DT, "TARGET_PROGRAMS", 2)
    assert DT.bwd_chunks(3, 63, 1) == (2, 1) and DT.bwd_chunks(1, 4096, 2) == (128, 1)
    _check_kernel((3, 7, 9, 40), torch.float32, "gelu", seed=3)
    x, w, b = (t.float().to(DEV).requires_grad_() for t in _inputs(2, 9, 13, 24, seed=4))
    dy = torch.randn(2, 117, 24, device=DEV)
    runs = [torch.autograd.grad(residual_dwconv_op(x, w, b, (9, 13), "gelu", triton=True), (x, w, b), dy)
            for _ in range(2)]
    assert all(torch.equal(p, q) for p, q in zip(*runs))


@triton_test
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="probes the offsets in the interpreter")
def test_token_offsets_are_int64_past_2_31():
    """The kernels' offset helper, ``(b N + token) C`` (every program's sample base), at a batch index whose offset
    passes 2^31 (H-ViT3-T's first stage at 2048 px: N = 512 x 512 tokens of 4 x 64 = 256 MLP channels; 2^31 from
    sample 32), fed through the same int32 arguments as the kernels without allocating that tensor.  Offsets inside
    a sample are int32: a sample of 2^31 elements or more is refused (meta tensors: nothing allocated)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(OUT, b0, N, C):
        b = DT.pid64(0) + b0
        tok = tl.arange(0, 2).to(tl.int32) + N - 2  # the last two tokens of the sample
        tl.store(OUT + tl.program_id(0).to(tl.int64) * 2 + tl.arange(0, 2), DT.token_offset(b, tok, N, C))

    n, c, b0 = 512 * 512, 256, 31
    out = torch.zeros(4, dtype=torch.int64)
    probe[(2,)](out, b0, n, c)
    want = [((b0 + p) * n + t) * c for p in range(2) for t in (n - 2, n - 1)]
    assert max(want) >= 2 ** 31 and out.tolist() == want
    big = torch.empty(1, 2 ** 23, 256, device="meta")
    with pytest.raises(ValueError, match="above the kernels' 2\\^31"):
        DT.residual_dwconv_fwd_triton(big, torch.empty(256, 1, 3, 3, device="meta"), None, (2 ** 13, 2 ** 10), None)


# ------------------------------------------------------------------------------------------------- the layers
def test_triton_path_only_in_eager(monkeypatch):
    x = torch.randn(1, 12, 4)
    assert triton_path(x, "torch") is None and triton_path(x, "torch_naive") is None
    assert triton_path(x, "auto") is None  # auto: CUDA only
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        assert triton_path(x, "triton") is not None
    with set_layer_config(exportable=True):  # the exporters and timm's exportable flag keep the aten conv
        assert triton_path(x, "triton") is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # torch.compile traces the aten conv too
    assert triton_path(x, "triton") is None
    assert triton_path(torch.fx.Proxy(torch.fx.Graph().placeholder("x")), "triton") is None


@pytest.mark.parametrize("name, cpe, mlp_dwconv", [("vit3", True, False), ("hvit3", True, True)])
@triton_test
def test_blocks_on_the_triton_path_match_pytorch(name, cpe, mlp_dwconv):
    """A TTTBlock whose CPE (and MLP conv) run the kernel: output and every parameter's gradient as on the PyTorch
    path (fp32; the mixer's own kernels take part too), in training (the MLP's recomputing backward) and inference."""
    from ttt_zoo.layers import TTTBlock
    torch.manual_seed(0)
    block = TTTBlock(32, 2, mixer="vit3", cpe=cpe, mlp_dwconv=mlp_dwconv).to(DEV)
    x = torch.randn(2, 6 * 10, 32, device=DEV)
    results = {}
    for backend in ("torch", "triton"):
        block.zero_grad()
        with use_backend(backend):
            xi = x.clone().requires_grad_()
            out = block(xi, (6, 10))
            out.square().sum().backward()
            with torch.no_grad():
                infer = block(x, (6, 10))
        results[backend] = [out, infer, xi.grad] + [p.grad for p in block.parameters()]
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
