"""The adaLN glue op of the DiT blocks (``kernels/adaln``): every path against the float64 reference.

The custom ops' PyTorch path against the plain reference in float64 and gradcheck (each function, and each
incoming gradient of the fused one alone); mixed dtypes; bad input; the Triton kernels (under TRITON_INTERPRET=1
without a GPU) forward and every gradient in float32 and float16 at N in the thousands, their launch counts and
their determinism.
"""
import pytest
import torch

from ttt_zoo.bench.launches import count_launches
from ttt_zoo.kernels.backend import use_backend
from _ops import DEV, triton_kernels, triton_test
from ttt_zoo.kernels import adaln as A

KT = triton_kernels("adaln")
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


# ------------------------------------------------------------------------------------------- the Triton kernels
KTOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # relative to each tensor's largest entry


@triton_test
@pytest.mark.parametrize("shape", [(2, 4096, 384), (2, 999, 72)], ids=["B2N4096C384", "B2N999C72"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", FNS)
def test_kernels_match_reference(name, dtype, shape):
    """Forward and every gradient (x, y, and the strided shift / scale / gate views) against the float64 reference
    run on the same (rounded) inputs."""
    fn, ref, _ = FNS[name]
    x, y, mods = _inputs(*shape, dtype=dtype, device=DEV)
    got, got_g = _fwd_bwd(name, lambda *a: fn(*a, triton=True), x, y, mods)
    want, want_g = _fwd_bwd(name, ref, x.double(), y.double(), mods.double())
    labels = [f"out{i}" for i in range(len(got))] + ["dx", "dy", "dmods"]
    for label, a, b in zip(labels, got + got_g, want + want_g):
        assert a.dtype == dtype, label
        if label == "dy" and FNS[name][2] == 1:
            continue  # modulate_norm takes no y
        top = b.abs().max().item()
        err = (a.double().cpu() - b).abs().max().item() / top
        assert err <= KTOL[dtype], f"{name} {label}: max error {err:.2e} of the largest entry {top:.3g}"


@triton_test
@pytest.mark.parametrize("which", [0, 1], ids=["x1_only", "h_only"])
def test_kernel_fused_with_one_incoming_gradient(which):
    x, y, mods = _leaves(*_inputs(2, 37, 40, dtype=torch.float32, device=DEV))
    args = _args("gate_residual_modulate_norm", x, y, mods)
    got = torch.autograd.grad(A.gate_residual_modulate_norm(*args, triton=True)[which].square().sum(), [x, y, mods])
    want = torch.autograd.grad(A.gate_residual_modulate_norm_reference(*args)[which].square().sum(), [x, y, mods])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def _strided_leaves(b, n, c, device):
    """x, y and (shift, scale, gate) as leaves: the vectors strided (batch stride 3C) without a view's backward."""
    x, y, mods = _inputs(b, n, c, dtype=torch.float32, device=device)
    return [x.requires_grad_(), y.requires_grad_()] + [v.detach().requires_grad_() for v in mods.unbind(1)]


@triton_test
def test_kernel_launch_counts():
    """One Triton launch forward each; backward 2 (modulate_norm), 1 (gate_residual: dx is the incoming gradient
    itself), 2 (the fused one); no aten launch on either side, also for the expanded gradient ``.sum().backward()``
    hands in (read through its strides, not copied); the gradients as the PyTorch path's."""
    x, y, shift, scale, gate = _strided_leaves(2, 33, 48, DEV)
    assert shift.stride() == (3 * 48, 1)
    calls = {"modulate_norm": (lambda t: A.modulate_norm(x, shift, scale, triton=t), [x, shift, scale], 2),
             "gate_residual": (lambda t: A.gate_residual(x, y, gate, triton=t), [x, y, gate], 1),
             "gate_residual_modulate_norm": (lambda t: A.gate_residual_modulate_norm(x, y, gate, shift, scale,
                                                                                     triton=t),
                                             [x, y, gate, shift, scale], 2)}
    for name, (call, leaves, bwd_launches) in calls.items():
        call(True)  # warm-up (compiles)
        box = {}
        fwd = count_launches(lambda: box.update(out=call(True)))
        assert (fwd.triton_total, fwd.aten_total) == (1, 0), (name, fwd.triton, fwd.aten)
        outs = box["out"] if isinstance(box["out"], tuple) else (box["out"],)
        ones = [torch.ones((), device=DEV).expand(o.shape) for o in outs]  # stride 0, as .sum().backward()
        bwd = count_launches(lambda: box.update(grads=torch.autograd.grad(outs, leaves, ones)))
        assert (bwd.triton_total, bwd.aten_total) == (bwd_launches, 0), (name, bwd.triton, bwd.aten)
        ref = call(False)
        want = torch.autograd.grad(ref, leaves, ones)
        for got, w in zip(box["grads"], want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


@triton_test
def test_kernel_backward_is_deterministic():
    x, y, shift, scale, gate = _strided_leaves(3, 517, 96, DEV)
    g = torch.Generator().manual_seed(3)
    go = [torch.randn(3, 517, 96, generator=g).to(DEV) for _ in range(2)]

    def grads():
        x1, h = A.gate_residual_modulate_norm(x, y, gate, shift, scale, triton=True)
        out = A.gate_residual(x1, A.modulate_norm(h, shift, scale, triton=True), gate, triton=True)
        return torch.autograd.grad([out, h], [x, y, shift, scale, gate], go)
    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@triton_test
def test_triton_path_follows_the_backend():
    x = torch.randn(1, 4, 8, device=DEV)
    with use_backend("torch"):
        assert A.triton_path(x, None) is None
    fused = A.triton_path(x, "triton")
    shift, scale, gate = (torch.randn(1, 8, device=DEV) * 0.1 for _ in range(3))
    torch.testing.assert_close(fused.modulate_norm(x, shift, scale),
                               A.modulate_norm_reference(x, shift, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("triton", [False] + ([True] if KT is not None else []), ids=lambda t: f"triton={t}")
@pytest.mark.parametrize("shape", [(0, 5, 8), (2, 0, 8)], ids=["B0", "N0"])
def test_empty_batch(triton, shape):
    x, y, mods = _leaves(*_inputs(*shape, dtype=torch.float32, device=DEV if triton else "cpu"))
    out = A.adaln_block_op(x, y, mods, triton=triton)
    assert out.shape == shape
    out.sum().backward()
    assert x.grad.shape == shape and torch.equal(mods.grad, torch.zeros_like(mods))


@triton_test
def test_batch_above_the_grid_limit_raises_one_line():
    x = torch.zeros(65536, 1, 8, device=DEV)
    v = torch.zeros(65536, 8, device=DEV)
    with pytest.raises(ValueError, match=r"^adaln: batch 65536 is above the kernels' 65535 samples per launch; "):
        A.modulate_norm(x, v, v, triton=True)
