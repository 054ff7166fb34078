"""The key instance-norm op of the T5 / DiT5 mixers (``kernels/key_norm``): every path against the reference.

torch (stores x + fp32 statistics) and the custom op against the reference in float64 and gradcheck; the Triton
kernels (under TRITON_INTERPRET=1 without a GPU) forward and backward, float32 and float16, on strided k slices;
the backend decision and an empty batch.
"""
import pytest
import torch
import torch.nn.functional as F

from _ops import BACKENDS, DEV, compare_kernel, triton_kernels, triton_test
from ttt_zoo.kernels import get_op, key_instance_norm
from ttt_zoo.kernels.key_norm import (identity_taps, key_norm_op, key_norm_reference, key_norm_torch, qk_norm_fold_op,
                                      qkv_fold_op)

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


# ------------------------------------------------ [q | key norm(k)] + the folded taps of both convs (qk_norm_fold)
def _fold_reference(q, k, eps, wq, bq, wk, bk, copy_qk=False):
    """The two residual depthwise convs written out: q + conv_q(q), kn + conv_k(kn), kn the reference key norm
    (``copy_qk``: then q and k themselves, which the op copies)."""
    return (torch.cat([q, key_norm_reference(k, eps)], -1), torch.cat([wq, wk]) + identity_taps(wq.repeat(2, 1, 1, 1)),
            torch.cat([bq, bk])) + ((q * 1, k * 1) if copy_qk else ())


def _fold_inputs(b, n, c, dtype, gen=None, taps=3):
    qkv = torch.randn(b, n, 3 * c, generator=gen, dtype=dtype) * 2 + 1
    ws = [torch.randn(c, 1, taps, taps, generator=gen, dtype=dtype) * 0.3, torch.randn(c, generator=gen, dtype=dtype),
          torch.randn(c, 1, taps, taps, generator=gen, dtype=dtype) * 0.3, torch.randn(c, generator=gen, dtype=dtype)]
    return qkv[..., :c], qkv[..., c:2 * c], ws  # strided q, k slices of a qkv output, as in the mixers


def test_qk_norm_fold_is_both_residual_convs_fp64():
    # one depthwise conv of the op's [q | kn] with its stacked taps and biases = the two convs with their residuals
    q, k, (wq, bq, wk, bk) = _fold_inputs(2, 5 * 4, 6, torch.float64)
    y, w, b = qk_norm_fold_op(q, k, 0.5, wq, bq, wk, bk, triton=False)
    both = F.conv2d(y.transpose(1, 2).reshape(2, 12, 5, 4), w, b, padding=1, groups=12).flatten(2).transpose(1, 2)
    kn = key_norm_reference(k, 0.5)
    for z, wz, bz, got in ((q, wq, bq, both[..., :6]), (kn, wk, bk, both[..., 6:])):
        zmap = z.transpose(1, 2).reshape(2, 6, 5, 4)
        want = z + F.conv2d(zmap, wz, bz, padding=1, groups=6).flatten(2).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # gradients: the op's backward (slices + the key norm's backward) against autograd of the written-out form
    leaves = [t.detach().requires_grad_() for t in (q, k, wq, bq, wk, bk)]
    outs = qk_norm_fold_op(leaves[0], leaves[1], 0.5, *leaves[2:], triton=False)
    refs = _fold_reference(leaves[0], leaves[1], 0.5, *leaves[2:])
    cots = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(outs, leaves, cots)
    want = torch.autograd.grad(refs, leaves, cots)
    for name, g, w_ in zip(["q", "k", "wq", "bq", "wk", "bk"], got, want):
        torch.testing.assert_close(g, w_, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    small = [t.detach()[:1, :6].clone().requires_grad_() for t in (q, k)] + [t.detach().clone().requires_grad_()
                                                                             for t in (wq, bq, wk, bk)]
    assert torch.autograd.gradcheck(lambda *a: qk_norm_fold_op(a[0], a[1], 0.5, *a[2:], triton=False), small,
                                    fast_mode=True)
    # with the copies of q and k (T5+'s neighbourhood attention): their gradients join q's and k's in the backward
    outs = qk_norm_fold_op(leaves[0], leaves[1], 0.5, *leaves[2:], triton=False, copy_qk=True)
    refs = _fold_reference(leaves[0], leaves[1], 0.5, *leaves[2:], copy_qk=True)
    assert len(outs) == 5 and torch.equal(outs[3], q) and torch.equal(outs[4], k)
    cots = [torch.randn_like(o) for o in outs]
    for name, g, w_ in zip(["q", "k", "wq", "bq", "wk", "bk"], torch.autograd.grad(outs, leaves, cots),
                           torch.autograd.grad(refs, leaves, cots)):
        torch.testing.assert_close(g, w_, rtol=1e-10, atol=1e-10, msg=lambda m: f"copies, {name}: {m}")
    with pytest.raises(ValueError, match="depthwise"):
        qk_norm_fold_op(q, k, 0.5, wq[:, :, :2], bq, wk[:, :, :2], bk)


FOLD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}  # of each tensor's largest magnitude


@pytest.mark.parametrize("n,b,c,taps,copy_qk", [(3136, 1, 64, 3, False), (196, 2, 40, 5, False),
                                                (3136, 1, 64, 3, True)], ids=["N3136C64", "N196b2C40k5", "N3136copies"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_qk_norm_fold_kernel_vs_float64(dtype, n, b, c, taps, copy_qk, monkeypatch):
    # the key-norm launch that also writes q beside kn and the folded taps / biases of both convs: every output and
    # every gradient against the float64 written-out form on the same (rounded) data; one launch forward, one back.
    # copy_qk (T5+): copies of q and k too, whose gradients the one backward launch adds to q's and k's
    from ttt_zoo.bench.launches import count_launches
    monkeypatch.setattr(KT, "BLOCK_N", 64)
    monkeypatch.setattr(KT, "BLOCK_C", 32)
    gen = torch.Generator().manual_seed(n)
    q, k, ws = _fold_inputs(b, n, c, dtype, gen, taps)
    leaves = [t.to(DEV).requires_grad_() for t in (q, k)] + [w.float().to(DEV).requires_grad_() for w in ws]
    ref_leaves = [t.double().requires_grad_() for t in (q, k)] + [w.double().requires_grad_() for w in ws]
    outs = qk_norm_fold_op(leaves[0], leaves[1], 1.0, *leaves[2:], triton=True, copy_qk=copy_qk)
    refs = _fold_reference(ref_leaves[0], ref_leaves[1], 1.0, *ref_leaves[2:], copy_qk=copy_qk)
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in refs]
    got = list(outs) + list(torch.autograd.grad(outs, leaves, [t.to(o.dtype).to(DEV) for t, o in zip(cots, outs)]))
    want = list(refs) + list(torch.autograd.grad(refs, ref_leaves, cots))
    names = ["y", "w", "b"] + ["qc", "kc"] * copy_qk + ["q", "k", "wq", "bq", "wk", "bk"]
    for name, g, w_ in zip(names, got, want):
        assert g.shape == w_.shape, name
        err = (g.cpu().double() - w_).abs().max() / w_.abs().max()
        assert err < FOLD_TOL[dtype], f"{name}: {err:.2e} of its max"
    assert outs[0].dtype == dtype and torch.equal(outs[0][..., :c].cpu(), q)  # q copied exactly
    with torch.no_grad():
        c_fwd = count_launches(lambda: qk_norm_fold_op(leaves[0], leaves[1], 1.0, *leaves[2:], triton=True))
    assert c_fwd.aten_total == 0 and dict(c_fwd.triton) == {"_knorm_fwd": 1}, (dict(c_fwd.aten), dict(c_fwd.triton))
    if copy_qk:  # the copies exact; the backward (dq and dk with the copies' gradients added) one launch
        assert torch.equal(outs[3].cpu(), q) and torch.equal(outs[4].cpu(), k)
        outs = qk_norm_fold_op(leaves[0], leaves[1], 1.0, *leaves[2:], triton=True, copy_qk=True)
        ones = [torch.ones_like(o) for o in outs[0:1] + outs[3:]]
        c_bwd = count_launches(lambda: torch.autograd.grad(outs[0:1] + outs[3:], leaves[:2], ones))
        assert dict(c_bwd.triton) == {"_knorm_bwd": 1} and c_bwd.aten_total == 0, (dict(c_bwd.aten),
                                                                                   dict(c_bwd.triton))


# ------------------------------------------------------------------------------- DiT5: qkv_fold_op (affine + convs)
def _qkv_fold_reference(qkv, eps, scale, offset, wq, bq, wk, bk, fs):
    """The written-out DiT5 form: the per-channel affine on q and k (``addcmul``), the key norm of k', each residual
    depthwise conv on its own (``z + conv(z)``), and q, k, v, v themselves (what the op copies)."""
    c = qkv.shape[-1] // 3
    q, k, v = qkv.split(c, -1)
    qa = torch.addcmul(offset[..., 0], q, scale[..., 0])
    kn = key_norm_reference(torch.addcmul(offset[..., 1], k, scale[..., 1]), eps)

    def res_conv(z, w, b):
        zmap = z.transpose(1, 2).reshape(z.shape[0], c, *fs)
        return z + F.conv2d(zmap, w, b, padding=w.shape[-1] // 2, groups=c).flatten(2).transpose(1, 2)
    return torch.cat([res_conv(qa, wq, bq), res_conv(kn, wk, bk)], -1), q * 1, k * 1, v * 1, v * 1


def _qkv_fold_inputs(b, fs, c, dtype, gen=None, taps=3):
    qkv = torch.randn(b, fs[0] * fs[1], 3 * c, generator=gen, dtype=dtype) * 2 + 1
    scale = torch.randn(1, 1, c, 2, generator=gen, dtype=dtype) * 0.5 + 1
    offset = torch.randn(1, 1, c, 2, generator=gen, dtype=dtype)
    _, _, ws = _fold_inputs(1, 1, c, dtype, gen, taps)
    return [qkv, scale, offset] + ws


QKV_NAMES = ["qkv", "scale", "offset", "wq", "bq", "wk", "bk"]


def _qkv_fold_call(leaves, eps, fs, triton):
    return qkv_fold_op(leaves[0], eps, *leaves[1:], fs, triton=triton)


@pytest.mark.parametrize("taps", [3, 5])
def test_qkv_fold_torch_path_fp64_and_gradcheck(taps):
    # the op's PyTorch path: every output and every gradient (d qkv with the copies' gradients added, the affine's,
    # the taps' and biases' sums) against autograd of the written-out form, and gradcheck
    gen = torch.Generator().manual_seed(taps)
    fs = (5, 4)
    inputs = _qkv_fold_inputs(2, fs, 6, torch.float64, gen, taps)
    leaves = [t.clone().requires_grad_() for t in inputs]
    ref_leaves = [t.clone().requires_grad_() for t in inputs]
    outs = _qkv_fold_call(leaves, 0.5, fs, False)
    refs = _qkv_fold_reference(ref_leaves[0], 0.5, *ref_leaves[1:], fs)
    assert len(outs) == len(refs) == 5
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in refs]
    for name, g, w_ in zip(QKV_NAMES, torch.autograd.grad(outs, leaves, cots),
                           torch.autograd.grad(refs, ref_leaves, cots)):
        torch.testing.assert_close(g, w_, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    small = [t.detach()[:1, :6].clone().requires_grad_() if i == 0 else t.detach().clone().requires_grad_()
             for i, t in enumerate(inputs)]
    assert torch.autograd.gradcheck(lambda *a: _qkv_fold_call(a, 0.5, (3, 2), False), small, fast_mode=True)
    with pytest.raises(ValueError, match=r"\(1, 1, 6, 2\)"):
        qkv_fold_op(inputs[0], 0.5, inputs[1][..., :1], *inputs[2:], fs)
    with pytest.raises(ValueError, match="5 x 5 map"):
        qkv_fold_op(inputs[0], 0.5, *inputs[1:], (5, 5))


@pytest.mark.parametrize("fs,b,c,taps", [((64, 64), 1, 64, 3), ((14, 13), 2, 40, 5)], ids=["64x64C64", "14x13b2C40k5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@triton_test
def test_qkv_fold_kernel_vs_float64(dtype, fs, b, c, taps, monkeypatch):
    # DiT5's launch on the qkv output (the affine, the key norm, both residual convs, the copies of q, k, v, v) and
    # its one backward launch (the whole d qkv, per-program partial sums of every parameter's gradient) + one sum,
    # against the float64 written-out form (addcmul, key norm, two convs, autograd) on the same (rounded) data
    from ttt_zoo.bench.launches import count_launches
    monkeypatch.setattr(KT, "BLOCK_N", 64)
    monkeypatch.setattr(KT, "BLOCK_C", 32)
    gen = torch.Generator().manual_seed(c)
    inputs = _qkv_fold_inputs(b, fs, c, dtype, gen, taps)
    leaves = [inputs[0].to(DEV).requires_grad_()] + [t.float().to(DEV).requires_grad_() for t in inputs[1:]]
    ref_leaves = [t.double().requires_grad_() for t in inputs]
    outs, grads = [], []  # one run, its launches counted
    c_fwd = count_launches(lambda: outs.extend(_qkv_fold_call(leaves, 1.0, fs, True)))
    refs = _qkv_fold_reference(ref_leaves[0], 1.0, *ref_leaves[1:], fs)
    cots = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in refs]
    cots_dev = [t.to(o.dtype).to(DEV) for t, o in zip(cots, outs)]
    c_bwd = count_launches(lambda: grads.extend(torch.autograd.grad(outs, leaves, cots_dev)))
    got = outs + grads
    want = list(refs) + list(torch.autograd.grad(refs, ref_leaves, cots))
    names = ["y", "qc", "kc", "vc", "vt"] + ["d" + x for x in QKV_NAMES]
    for name, g, w_ in zip(names, got, want):
        assert g.shape == w_.shape, name
        g = g.cpu().double()
        if name == "doffset":  # k's offset cancels in the key norm: its gradient is zero up to rounding
            assert g[..., 1].abs().max() < FOLD_TOL[dtype] * w_[..., 0].abs().max(), name
            g, w_ = g[..., 0], w_[..., 0]
        err = (g - w_).abs().max() / w_.abs().max()
        assert err < FOLD_TOL[dtype], f"{name}: {err:.2e} of its max"
    assert outs[0].dtype == dtype and all(torch.equal(o.cpu(), r.to(dtype)) for o, r in zip(outs[1:], refs[1:]))
    assert c_fwd.aten_total == 0 and dict(c_fwd.triton) == {"_dit5_fwd": 1}, (dict(c_fwd.aten), dict(c_fwd.triton))
    assert dict(c_bwd.triton) == {"_dit5_bwd": 1} and dict(c_bwd.aten) == {"sum": 1}, (dict(c_bwd.aten),
                                                                                      dict(c_bwd.triton))
