"""The adaLN glue op of the DiT blocks (``kernels/adaln``): every path against the float64 reference.

The custom ops' PyTorch path against the plain reference in float64 and gradcheck (each function, and each
incoming gradient of the fused one alone); mixed dtypes; bad input; the Triton kernels (under TRITON_INTERPRET=1
without a GPU) forward and every gradient in float32 and float16 at N in the thousands, their launch counts and
their determinism.
"""
import pytest
import torch

from _ops import DEV, triton_kernels, triton_test
from ttt_zoo.kernels import adaln as A

KT = None  # the Triton kernels come in the next commit
EPS = 1e-6
FNS = {  # name -> (the custom op's function, the reference, the number of (B, N, C) inputs)
    "modulate_norm": (A.modulate_norm, A.modulate_norm_reference, 1),
    "gate_residual": (A.gate_residual, A.gate_residual_reference, 2),
    "gate_residual_modulate_norm": (A.gate_residual_modulate_norm, A.gate_residual_modulate_norm_reference, 2),
}


def _inputs(b, n, c, dtype=torch.float64, device="cpu", vec_dtype=None, seed=0):
    """x ~ N(0, 1) with a per-channel offset, y ~ N(0, 1), and (shift, scale, gate) ~ 0.1 N(0, 1) as strided views
    of one (B, 3, C) tensor (as a DiT's modulation chunks are)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, c, generator=g, dtype=torch.float64) + torch.randn(c, generator=g, dtype=torch.float64) * 2
    y = torch.randn(b, n, c, generator=g, dtype=torch.float64)
    mods = torch.randn(b, 3, c, generator=g, dtype=torch.float64) * 0.1
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), y.to(dtype=dtype, **to), mods.to(dtype=vec_dtype or dtype, **to))


def _args(name, x, y, mods):
    shift, scale, gate = mods.unbind(1)
    return {"modulate_norm": (x, shift, scale), "gate_residual": (x, y, gate),
            "gate_residual_modulate_norm": (x, y, gate, shift, scale)}[name]


def _call(name, fn, x, y, mods, **kw):
    out = fn(*_args(name, x, y, mods), **kw)
    return out if isinstance(out, tuple) else (out,)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _fwd_bwd(name, fn, x, y, mods, seed=1, **kw):
    """Outputs and the gradients of x, y, mods under random incoming gradients (fixed by ``seed``)."""
    x, y, mods = _leaves(x, y, mods)
    outs = _call(name, fn, x, y, mods, **kw)
    g = torch.Generator().manual_seed(seed)
    gos = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o) for o in outs]
    grads = torch.autograd.grad(outs, [x, y, mods], gos, allow_unused=True)
    return list(outs), [torch.zeros_like(t) if d is None else d for t, d in zip((x, y, mods), grads)]


@pytest.mark.parametrize("name", FNS)
def test_torch_path_matches_reference_fp64_and_gradcheck(name):
    fn, ref, _ = FNS[name]
    x, y, mods = _inputs(2, 7, 12)
    got, got_g = _fwd_bwd(name, lambda *a: fn(*a, triton=False), x, y, mods)
    want, want_g = _fwd_bwd(name, ref, x, y, mods)
    for a, b in zip(got + got_g, want + want_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    leaves = _leaves(x, y, mods)
    assert torch.autograd.gradcheck(lambda *t: _call(name, fn, *t, triton=False), leaves)


@pytest.mark.parametrize("which", [0, 1], ids=["x1_only", "h_only"])
def test_fused_with_one_incoming_gradient(which):
    """gate_residual_modulate_norm's backward with g_x1 or g_h None (the other output unused)."""
    x, y, mods = _leaves(*_inputs(2, 5, 8))
    assert torch.autograd.gradcheck(
        lambda *t: A.gate_residual_modulate_norm(*_args("gate_residual_modulate_norm", *t), triton=False)[which],
        [x, y, mods])
    ref = A.gate_residual_modulate_norm_reference(*_args("gate_residual_modulate_norm", x, y, mods))[which]
    got = A.gate_residual_modulate_norm(*_args("gate_residual_modulate_norm", x, y, mods), triton=False)[which]
    want_g = torch.autograd.grad(ref.sum(), [x, y, mods])
    got_g = torch.autograd.grad(got.sum(), [x, y, mods])
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_block_chain_fp64():
    """The verification case (the three functions chained as a DiT block) against the reference, and gradcheck."""
    x, y, mods = _leaves(*_inputs(2, 6, 10))
    torch.testing.assert_close(A.adaln_block_torch(x, y, mods), A.adaln_block_reference(x, y, mods),
                               rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(A.adaln_block_torch, [x, y, mods])


def test_layer_norm_semantics():
    """modulate_norm with zero shift and scale is torch's LayerNorm without affine parameters."""
    x, _, mods = _inputs(3, 11, 24, dtype=torch.float32)
    zero = torch.zeros(3, 24)
    torch.testing.assert_close(A.modulate_norm(x, zero, zero, EPS, triton=False),
                               torch.nn.functional.layer_norm(x, (24,), eps=EPS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("triton", [False] + ([True] if KT is not None else []), ids=lambda t: f"triton={t}")
def test_mixed_dtypes(triton):
    """fp16 tokens with fp32 modulation vectors: fp32 outputs (eager promotion), each gradient in its input's dtype."""
    x, y, mods = _inputs(2, 9, 16, dtype=torch.float16, vec_dtype=torch.float32, device=DEV if triton else "cpu")
    for name, (fn, ref, _) in FNS.items():
        got, got_g = _fwd_bwd(name, lambda *a: fn(*a, triton=triton), x, y, mods)
        want, want_g = _fwd_bwd(name, ref, x.double(), y.double(), mods.double())
        for o in got:
            assert o.dtype == torch.float32, name
        assert [g.dtype for g in got_g] == [torch.float16, torch.float16, torch.float32], name
        for a, b in zip(got + got_g, want + want_g):
            torch.testing.assert_close(a.double(), b.to(a.device), rtol=2e-3, atol=2e-3 * b.abs().max().item())


@pytest.mark.parametrize("bad, match", [
    (lambda x, y, m: A.modulate_norm(x[0], m[:, 0], m[:, 1]), r"x must be \(B, N, C\)"),
    (lambda x, y, m: A.modulate_norm(x, m[:, 0, :5], m[:, 1]), r"shift must be \(B, C\) = \(2, 8\)"),
    (lambda x, y, m: A.modulate_norm(x, m[:1, 0], m[:, 1]), r"shift must be \(B, C\)"),
    (lambda x, y, m: A.gate_residual(x, y[..., :4], m[:, 2]), r"y \(2, 3, 4\) and x \(2, 3, 8\) differ"),
    (lambda x, y, m: A.gate_residual(x.long(), y, m[:, 2]), r"x must be a floating-point tensor"),
    (lambda x, y, m: A.gate_residual_modulate_norm(x, y, m[:, 2], m[:, 0], m[:, 1].int()),
     r"scale must be a floating-point tensor"),
])
def test_bad_input_raises_one_line(bad, match):
    x, y, mods = _inputs(2, 3, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=match) as info:
        bad(x, y, mods)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("adaln: ") and "; " in msg


def test_meta_device_shapes_and_dtypes():
    x, y, mods = (t.to("meta") for t in _inputs(2, 5, 8, dtype=torch.float16, vec_dtype=torch.float32))
    shift, scale, gate = mods.unbind(1)
    for triton in (False, True):
        h = A.modulate_norm(x, shift, scale, triton=triton)
        x1, h2 = A.gate_residual_modulate_norm(x, y, gate, shift, scale, triton=triton)
        out = A.gate_residual(x, y, gate, triton=triton)
        assert h.device.type == "meta" and h.shape == x.shape and h.dtype == torch.float32
        assert x1.dtype == h2.dtype == out.dtype == torch.float32
