"""DiT5: neighbourhood attention (natten border rule), the regression inner step, fixture parity, parameter
counts, and linearize_dit's exact inheritance."""
import importlib.util

import pytest
import timm
import torch
import torch.nn.functional as F

from _ops import DEV, triton_test
from fixtures import load_fixture
from ttt_zoo.kernels import mlp_ttt_reference
from ttt_zoo.layers.neighborhood import (neighborhood_attention_2d, neighborhood_attention_2d_torch,
                                         neighborhood_indices)
from ttt_zoo.models import DiT
from ttt_zoo.models.dit import checkpoint_filter_fn
from ttt_zoo.linearize import dit5_param_groups, linearize_dit

# spec §6 table: params at input_size 32, 1000 classes
DIT5_PARAMS = {
    "s": (33_663_776, 33_645_440, 33_848_576),
    "b": (131_913_248, 131_876_480, 132_282_368),
    "l": (461_838_368, 461_789_312, 462_330_368),
    "xl": (680_548_640, 680_493_440, 681_102_080),
}


@pytest.mark.parametrize("size", list(DIT5_PARAMS))
def test_dit5_official_param_counts(size):
    for patch, expected in zip((2, 4, 8), DIT5_PARAMS[size]):
        with torch.device("meta"):
            model = timm.create_model(f"dit5_{size}_{patch}")
        n = sum(p.numel() for p in model.parameters())
        assert n == expected, f"dit5_{size}_{patch}: {n} != official {expected}"


def _naive_na(q, k, v, ks, dil, scale):
    """Loop over queries; window per axis from the natten rule written out directly."""
    b, nh, h, w, d = q.shape

    def window(i, length):
        r = i % dil
        group = list(range(r, length, dil))  # the dilated sub-grid containing i
        j = group.index(i)
        start = min(max(j - ks // 2, 0), len(group) - ks)
        return group[start:start + ks]

    out = torch.empty_like(q)
    for i in range(h):
        for j in range(w):
            keys = [(r, c) for r in window(i, h) for c in window(j, w)]  # row-major in the window
            kk = torch.stack([k[:, :, r, c] for r, c in keys], dim=2)  # b, nh, K, d
            vv = torch.stack([v[:, :, r, c] for r, c in keys], dim=2)
            a = ((q[:, :, i, j, None, :] * scale) * kk).sum(-1).softmax(-1)
            out[:, :, i, j] = (a[..., None] * vv).sum(-2)
    return out


@pytest.mark.parametrize("ks,dil,shape", [(5, 1, (6, 9)), (3, 1, (5, 3)), (5, 1, (5, 5)), (3, 2, (7, 8))])
def test_neighborhood_attention_matches_naive(ks, dil, shape):
    q, k, v = (torch.randn(2, 2, *shape, 8, dtype=torch.float64) for _ in range(3))
    out = neighborhood_attention_2d_torch(q, k, v, ks, dil, 0.3)
    torch.testing.assert_close(out, _naive_na(q, k, v, ks, dil, 0.3), rtol=1e-12, atol=1e-12)


def test_neighborhood_indices_border_rule():
    # length 8, kernel 5: windows start at clamp(i - 2, 0, 3)
    starts = neighborhood_indices(8, 5)[:, 0].tolist()
    assert starts == [0, 0, 0, 1, 2, 3, 3, 3]
    assert (neighborhood_indices(8, 5).diff(dim=1) == 1).all()


def test_neighborhood_window_larger_than_map_errors():
    q = torch.randn(1, 1, 4, 8, 8)
    with pytest.raises(ValueError, match="smaller than the neighbourhood window"):
        neighborhood_attention_2d(q, q, q, 5)
    with pytest.raises(ValueError, match="odd kernel_size"):
        neighborhood_attention_2d(q, q, q, 4)


@pytest.mark.skipif(importlib.util.find_spec("natten") is None,
                    reason="natten is optional, outside the pinned stack (no build for this torch)")
def test_natten_matches_torch():
    q, k, v = (torch.randn(2, 2, 9, 11, 16) for _ in range(3))
    out = neighborhood_attention_2d(q, k, v, 5, use_natten=True)
    torch.testing.assert_close(out, neighborhood_attention_2d_torch(q, k, v, 5), rtol=1e-5, atol=1e-5)


def test_mlp_ttt_step_equals_autograd():
    b, nh, n, d, scale = 2, 3, 10, 4, 0.5
    q, k, v = (torch.randn(b, nh, n, d, dtype=torch.float64) for _ in range(3))
    w1, w2 = (torch.randn(1, nh, d, d, dtype=torch.float64) * 0.5 for _ in range(2))
    # per-sample copies; the summed loss gives each copy its own sample's gradient
    p1 = w1.expand(b, -1, -1, -1).clone().requires_grad_()
    p2 = w2.expand(b, -1, -1, -1).clone().requires_grad_()
    loss = (scale / (2 * n)) * ((F.silu(k @ p1) @ p2 - v) ** 2).sum()
    g1, g2 = torch.autograd.grad(loss, (p1, p2))
    ref = F.silu(q @ (p1 - g1)) @ (p2 - g2)
    torch.testing.assert_close(mlp_ttt_reference(q, k, v, w1, w2, scale), ref.detach(), rtol=1e-12, atol=1e-12)


def _tiny5(**kw):
    args = dict(input_size=16, patch_size=2, in_chans=4, hidden_size=64, depth=2, num_heads=2, num_classes=10,
                mixer="dit5_mixed")
    args.update(kw)
    return DiT(**args)


def test_dit5_matches_official():
    t, state, meta, tol = load_fixture("dit5_model_tiny")
    model = _tiny5().eval()
    model.load_state_dict(checkpoint_filter_fn({"model": state}, model), strict=True)
    with torch.no_grad():
        out = model(t["input.x"], t["input.t"], t["input.y"])
    torch.testing.assert_close(out, t["output"], **tol)
    with torch.no_grad():  # float64 runs too and agrees
        out64 = model.double()(t["input.x"].double(), t["input.t"], t["input.y"])
    torch.testing.assert_close(out64, t["output"].double(), **tol)


@triton_test
def test_dit5_triton_path_matches_official():
    """The fixture on the Triton path (the mixer's fused qkv launch, the stacked inner step): the official output."""
    from ttt_zoo.bench.launches import count_launches
    from ttt_zoo.kernels.backend import use_backend
    t, state, meta, tol = load_fixture("dit5_model_tiny")
    model = _tiny5().eval().to(DEV)
    model.load_state_dict(checkpoint_filter_fn({"model": state}, model), strict=True)
    inputs = [t[k].to(DEV) for k in ("input.x", "input.t", "input.y")]
    out = []
    with torch.no_grad(), use_backend("triton"):
        counts = count_launches(lambda: out.append(model(*inputs)))
    torch.testing.assert_close(out[0].cpu(), t["output"], **tol)
    # one launch per block for the q / k affine, the key norm and both convs
    assert counts.triton["_dit5_fwd"] == 2 and counts.by_op["qkv_fold_fwd"] == 2, counts.table()


def _mixer_params_random(mixer, gen):
    with torch.no_grad():  # the affine away from its init (ones, zeros), the convs' biases nonzero
        for p in mixer.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.3 if p.dim() > 2 else 0.5))


@triton_test
def test_dit5_mixer_triton_path_vs_float64():
    """The mixer on the Triton path (one fused launch on the qkv output each way, q / k affine included) against the
    PyTorch path in float64: the output and every gradient (input, affine, convs, inner weights, projections)."""
    from ttt_zoo.kernels.backend import use_backend
    from ttt_zoo.layers.dit5_mixer import DiT5MixedAttention
    gen = torch.Generator().manual_seed(0)
    mixer = DiT5MixedAttention(128, num_heads=2)
    _mixer_params_random(mixer, gen)
    fs = (12, 10)
    x = torch.randn(2, fs[0] * fs[1], 128, generator=gen)
    cot = torch.randn(2, fs[0] * fs[1], 128, generator=gen, dtype=torch.float64)
    results = []
    for backend, dtype, dev in (("torch", torch.float64, "cpu"), ("triton", torch.float32, DEV)):
        m = mixer.to(dev, dtype)
        m.zero_grad(set_to_none=True)
        xx = x.to(dev, dtype).requires_grad_()
        with use_backend(backend):
            out = m(xx, fs)
        (out * cot.to(dev, dtype)).sum().backward()
        results.append([out, xx.grad] + [p.grad for p in m.parameters()])
    names = ["out", "x"] + [n for n, _ in mixer.named_parameters()]
    for name, want, got in zip(names, *results):
        err = (got.cpu().double() - want).abs().max() / want.abs().max()
        if name == "qk_offset_ttt":  # k's offset cancels in the key norm: zero up to rounding
            err = (got[..., 0].cpu().double() - want[..., 0]).abs().max() / want[..., 0].abs().max()
            assert got[..., 1].abs().max() < 1e-5 * want[..., 0].abs().max(), name
        assert err < 2e-5, f"{name}: {err:.2e} of its max"


def test_dit5_non_square_and_small_latent():
    model = _tiny5().eval()
    t, y = torch.tensor([3, 700]), torch.tensor([1, 10])
    with torch.no_grad():
        assert model(torch.randn(2, 4, 10, 14), t, y).shape == (2, 8, 10, 14)
        # 4 x 7 token map < 5 x 5 window: the window is clamped to the 4 rows (attended in full)
        out = model(torch.randn(2, 4, 8, 14), t, y)
        assert out.shape == (2, 8, 8, 14) and torch.isfinite(out).all()
        # dilation 2 is not clamped: a 7-wide map is smaller than its 10-wide window
        dilated = _tiny5(mixer_kwargs=dict(dilation=2)).eval()
        with pytest.raises(ValueError, match="smaller than the neighbourhood window"):
            dilated(torch.randn(2, 4, 14, 14), t, y)


def _masked_attention(q, k, v, scale, allowed):
    """softmax(q k^T * scale) v over the flattened map, keys restricted by allowed (HW, HW); independent of the NA
    code (no windows, no gathers)."""
    b, nh, h, w, d = q.shape
    qf, kf, vf = (x.reshape(b, nh, h * w, d) for x in (q, k, v))
    logits = (qf * scale) @ kf.transpose(-1, -2)
    out = logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ vf
    return out.reshape(b, nh, h, w, d)


def _na_paths(q, k, v, ks, scale):
    """The clamped NA through every PyTorch path: the public function, the tiled form, the gather form."""
    return {"public": neighborhood_attention_2d(q, k, v, ks, 1, scale, clamp_to_map=True),
            "tiled": neighborhood_attention_2d_torch(q, k, v, ks, 1, scale, tile=2, clamp_to_map=True),
            "gather": neighborhood_attention_2d_torch(q, k, v, ks, 1, scale, tile=0, clamp_to_map=True)}


@pytest.mark.parametrize("ks,shape", [(5, (4, 4)), (5, (3, 5)), (5, (1, 4)), (7, (2, 6)), (5, (5, 5))])
def test_clamped_window_equals_full_attention(ks, shape):
    """A window that covers the map (clamped, or exactly the map's size) is full attention over the map: values and
    gradients match plain softmax attention in float64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, *shape, 8, dtype=torch.float64, generator=g) for _ in range(3))
    n = shape[0] * shape[1]
    full = torch.ones(n, n, dtype=torch.bool)
    ref = _masked_attention(q, k, v, 0.4, full)
    for name, out in _na_paths(q, k, v, ks, 0.4).items():
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=name)
    # gradients through the public path
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(neighborhood_attention_2d(*leaves, ks, 1, 0.4, clamp_to_map=True).sum(), leaves)
    leaves_ref = [x.clone().requires_grad_() for x in (q, k, v)]
    grads_ref = torch.autograd.grad(_masked_attention(*leaves_ref, 0.4, full).sum(), leaves_ref)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # not clamping: a map smaller than the window is still an error
    if min(shape) < ks:
        with pytest.raises(ValueError, match="smaller than the neighbourhood window"):
            neighborhood_attention_2d(q, k, v, ks, 1, 0.4)


def test_clamp_one_axis_keeps_the_other_window():
    """4 x 7 map, kernel 5: every row is attended (clamped axis), columns keep natten's 5-wide window."""
    g = torch.Generator().manual_seed(1)
    h, w, ks = 4, 7, 5
    q, k, v = (torch.randn(1, 2, h, w, 4, dtype=torch.float64, generator=g) for _ in range(3))
    allowed = torch.zeros(h * w, h * w, dtype=torch.bool)
    for i in range(h):
        for j in range(w):
            start = min(max(j - ks // 2, 0), w - ks)  # natten's border rule along the unclamped axis
            for r in range(h):
                for c in range(start, start + ks):
                    allowed[i * w + j, r * w + c] = True
    assert allowed.sum(1).eq(h * ks).all()
    ref = _masked_attention(q, k, v, 0.5, allowed)
    for name, out in _na_paths(q, k, v, ks, 0.5).items():
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=name)
    assert neighborhood_indices(4, 5, clamp_to_map=True).tolist() == [[0, 1, 2, 3]] * 4
    with pytest.raises(ValueError, match="clamp_to_map clamps dilation-1 windows only"):
        neighborhood_attention_2d(q, k, v, 3, 2, 0.5, clamp_to_map=True)  # 4 rows < 3 x 2


def test_dit5_mixer_na_half_is_full_attention_on_a_small_map():
    """The mixer's NA half at a 4 x 4 map (kernel 5): full softmax attention over the 16 tokens, per head."""
    from ttt_zoo.layers.dit5_mixer import DiT5MixedAttention
    torch.manual_seed(0)
    mixer = DiT5MixedAttention(16, num_heads=2).double().eval()
    assert mixer.kernel_size == 5
    q, k, v = (torch.randn(2, 16, 16, dtype=torch.float64) for _ in range(3))
    out = mixer._na(q, k, v, (4, 4))  # (B, heads, N, d)
    heads = lambda x: x.reshape(2, 16, 2, 8).transpose(1, 2)  # noqa: E731
    ref = ((heads(q) @ heads(k).transpose(-1, -2)) * mixer.scale).softmax(-1) @ heads(v)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


DIT5_8 = [f"dit5_{s}_8" for s in DIT5_PARAMS]


def test_dit5_8_list_is_the_registry():
    assert sorted(DIT5_8) == sorted(n for n in timm.list_models("dit5_*_8"))


@pytest.mark.parametrize("name", DIT5_8)
def test_dit5_8_runs_at_its_pretrained_input_size(name):
    """Each dit5_*_8 at its own pretrained_cfg input size (32x32 latents: a 4 x 4 token map, smaller than the 5 x 5
    window), at a small width (the spatial size is the point); dit5_s_8 also at its full default width."""
    cfg = timm.get_pretrained_cfg(name).to_dict()
    c, hh, ww = cfg["input_size"]
    small = dict(hidden_size=32, depth=1, num_heads=2)
    torch.manual_seed(0)
    for kw in ([small, {}] if name == "dit5_s_8" else [small]):
        model = timm.create_model(name, **kw).eval()
        assert model.grid_size == (hh // 8, ww // 8) == (4, 4)
        assert model.blocks[0].attn.kernel_size == 5 > model.grid_size[0]
        x = torch.randn(2, c, hh, ww)
        with torch.no_grad():
            out = model(x, torch.tensor([1, 999]), torch.tensor([0, 7]))
        assert out.shape == (2, 2 * c, hh, ww) and torch.isfinite(out).all()


def _softmax_tiny():
    model = DiT(input_size=16, patch_size=2, in_chans=4, hidden_size=64, depth=2, num_heads=2, num_classes=10,
                mixer="softmax")
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    return model


def test_linearize_dit_inherits_every_tensor_exactly():
    src = _softmax_tiny().eval()
    new, new_names = linearize_dit(src)
    per_block = ["attn.w1", "attn.w2", "attn.qk_scale_ttt", "attn.qk_offset_ttt", "attn.q_conv2d.weight",
                 "attn.q_conv2d.bias", "attn.k_conv2d.weight", "attn.k_conv2d.bias"]
    assert new_names == sorted(f"blocks.{i}.{n}" for i in range(2) for n in per_block)
    src_sd, new_sd = src.state_dict(), new.state_dict()
    assert set(new_sd) == set(src_sd) | set(new_names)
    for name, tensor in src_sd.items():
        assert torch.equal(new_sd[name], tensor), name
        assert new_sd[name].data_ptr() != tensor.data_ptr()  # a copy, not shared storage
    for blk in new.blocks:
        assert torch.equal(blk.attn.qk_scale_ttt, torch.ones_like(blk.attn.qk_scale_ttt))
        assert torch.equal(blk.attn.qk_offset_ttt, torch.zeros_like(blk.attn.qk_offset_ttt))
        assert 0 < blk.attn.w1.std() < 0.05
    assert not new.training and not new.pos_embed.requires_grad
    x, t, y = torch.randn(2, 4, 16, 16), torch.tensor([10, 900]), torch.tensor([0, 10])
    with torch.no_grad():
        assert torch.isfinite(new(x, t, y)).all()
    # the released path: a timm-built softmax DiT
    with torch.device("meta"):
        dit5, names = linearize_dit(timm.create_model("dit_s_2"))
    assert len(names) == 12 * 8 and dit5.pretrained_cfg["architecture"] == "dit5_s_2"
    assert sum(p.numel() for p in dit5.parameters()) == DIT5_PARAMS["s"][0]


def test_linearize_rejects_non_softmax_dit():
    with pytest.raises(TypeError, match="softmax DiT"):
        linearize_dit(_tiny5())


def test_dit5_param_groups_double_lr_for_inner_weights():
    new, new_names = linearize_dit(_softmax_tiny())
    base, boosted = dit5_param_groups(new, lr=1e-4)
    assert boosted["lr"] == pytest.approx(2e-4) and base["lr"] == pytest.approx(1e-4)
    boosted_ids = {id(p) for p in boosted["params"]}
    expected = {id(p) for n, p in new.named_parameters() if n.endswith(("attn.w1", "attn.w2"))}
    assert boosted_ids == expected and len(expected) == 4
    trainable = [p for p in new.parameters() if p.requires_grad]
    assert len(base["params"]) + len(boosted["params"]) == len(trainable)
    assert all(p is not new.pos_embed for p in base["params"])
    # or boost every newly initialised parameter
    _, all_new = dit5_param_groups(new, lr=1e-4, names=new_names)
    assert len(all_new["params"]) == len(new_names)
    torch.optim.AdamW(dit5_param_groups(new, lr=1e-4))  # accepted by an optimizer
