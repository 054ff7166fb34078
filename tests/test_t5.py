"""T5 / T5+ classifiers: official parity, exact parameter counts, any input size, neighbourhood attention."""
import json

import pytest
import timm
import torch
import torch.nn.functional as F

from fixtures import assert_classifier_matches, load_fixture
from ttt_zoo.layers import T5TTT, neighborhood_attention_2d
from ttt_zoo.layers.neighborhood import neighborhood_attention_2d_torch
from ttt_zoo.models import T5
from ttt_zoo.models._common import CheckpointError
from ttt_zoo.models.t5 import checkpoint_filter_fn


def _fixture_model():
    t, state, meta, tol = load_fixture("t5_model_tiny")
    kw = json.loads(meta["constructor_kwargs"])
    model = T5(img_size=kw["img_size"], patch_size=kw["patch_size"], embed_dim=kw["embed_dim"], depth=kw["depth"],
               num_heads=kw["num_heads"], num_classes=kw["num_classes"], mlp_ratio=kw["mlp_ratio"],
               qkv_bias=kw["qkv_bias"]).double().eval()
    return t, state, meta, tol, model


@pytest.mark.parametrize("layout", ["main_py", "bare"])
def test_t5_matches_official(layout):
    t, state, meta, tol, model = _fixture_model()
    assert list(model.state_dict()) == json.loads(meta["state_dict_keys_in_order"])
    if layout == "main_py":  # T5/main.py saves both; the raw model is what it evaluates
        junk = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt = {"model": state, "model_ema": junk, "epoch": 1, "newly_initialized_params": ["blocks.0.attn.w1"]}
    else:
        ckpt = state
    model.load_state_dict(checkpoint_filter_fn(ckpt, model), strict=True)
    assert_classifier_matches(model, t, tol)


def test_filter_rejects_wrong_size():
    t, state, meta, tol, model = _fixture_model()
    bad = dict(state)
    bad["blocks.0.attn.w1"] = bad["blocks.0.attn.w1"][:, :1]
    with pytest.raises(CheckpointError, match="blocks.0.attn.w1"):
        checkpoint_filter_fn(bad, model)


@pytest.mark.parametrize("prefix", [0, 1])
def test_filter_resamples_pos_embed_of_other_grid(prefix):
    """A 7x7 pos_embed (optionally after a DeiT class-token slot) loads into a 4x4-grid model, bicubic-resampled."""
    from timm.layers import resample_abs_pos_embed
    model = T5(img_size=64, patch_size=16, embed_dim=32, depth=1, num_heads=2, num_classes=5)
    grid = torch.randn(1, 49, 32)
    sd = dict(model.state_dict(), pos_embed=torch.cat([torch.randn(1, prefix, 32), grid], 1))
    out = checkpoint_filter_fn(sd, model)["pos_embed"]
    torch.testing.assert_close(out, resample_abs_pos_embed(grid, new_size=[4, 4], old_size=[7, 7], num_prefix_tokens=0))
    sd["pos_embed"] = torch.randn(1, 20, 32)
    with pytest.raises(CheckpointError, match="20 tokens is not a square grid"):
        checkpoint_filter_fn(sd, model)


@pytest.mark.parametrize("name,count", [("t5_tiny", 6_205_480), ("t5_small", 23_026_792), ("t5_base", 79_270_376),
                                        ("t5_plus_tiny", 6_205_480), ("t5_plus_base", 79_270_376)])
def test_param_counts_exact(name, count):
    with torch.device("meta"):
        model = timm.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == count


def test_any_input_size_resamples_pos_embed():
    model = T5(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=5).eval()
    x = torch.randn(2, 3, 24, 40)
    out = model.forward_features(x)
    assert out.shape == (2, 6, 10, 32)
    assert model(x).shape == (2, 5)
    # at the training size no resampling happens: the pos_embed is added as is
    tokens, feat = model._embed(torch.zeros(1, 3, 32, 32))
    assert feat == (8, 8)
    torch.testing.assert_close(tokens - model.patch_embed(torch.zeros(1, 3, 32, 32)).flatten(1, 2), model.pos_embed)
    with pytest.raises(ValueError, match="divisible by its patch size 4"):
        model(torch.randn(1, 3, 30, 32))


@pytest.mark.parametrize("na_kernel", [0, 3])
def test_mixer_nonsquare_is_transpose_equivariant(na_kernel):
    """Transposing the H x W map (and the conv kernels) must transpose the output: catches any H/W mix-up."""
    torch.manual_seed(0)
    h, w, c = 3, 5, 16
    m = T5TTT(c, num_heads=2, na_kernel=na_kernel).double().eval()
    mt = T5TTT(c, num_heads=2, na_kernel=na_kernel).double().eval()
    sd = m.state_dict()
    for key in ("q_conv2d.weight", "k_conv2d.weight"):
        sd[key] = sd[key].transpose(-1, -2)
    mt.load_state_dict(sd)
    x = torch.randn(2, h * w, c, dtype=torch.float64)
    xt = x.reshape(2, h, w, c).transpose(1, 2).reshape(2, h * w, c)
    with torch.no_grad():
        out = m(x, (h, w))
        out_t = mt(xt, (w, h))
    torch.testing.assert_close(out_t, out.reshape(2, h, w, c).transpose(1, 2).reshape(2, h * w, c))


def _naive_na(q, k, v, h, w, kernel, scale):
    b, heads, n, d = q.shape
    out = torch.zeros_like(q)
    r = kernel // 2
    for i in range(h):
        si = min(max(i - r, 0), h - kernel)
        for j in range(w):
            sj = min(max(j - r, 0), w - kernel)
            keys = [(si + a) * w + (sj + c) for a in range(kernel) for c in range(kernel)]
            logits = (q[:, :, i * w + j, None] * k[:, :, keys]).sum(-1) * scale
            out[:, :, i * w + j] = (logits.softmax(-1)[..., None] * v[:, :, keys]).sum(-2)
    return out


@pytest.mark.parametrize("kernel,h,w", [(3, 4, 6), (5, 5, 7), (5, 6, 6)])
def test_neighborhood_attention_border_rule(kernel, h, w):
    q, k, v = torch.randn(3, 2, 2, h * w, 4, dtype=torch.float64)
    grid = (2, 2, h, w, 4)
    out = neighborhood_attention_2d(q.reshape(grid), k.reshape(grid), v.reshape(grid), kernel, 1, 0.5)
    torch.testing.assert_close(out.flatten(2, 3), _naive_na(q, k, v, h, w, kernel, 0.5))


def test_neighborhood_attention_too_small_map():
    q = torch.randn(1, 1, 3, 4, 4)
    with pytest.raises(ValueError, match="side 3 is smaller than the neighbourhood window"):
        neighborhood_attention_2d(q, q, q, 5, 1, 1.0)
    model = timm.create_model("t5_plus_tiny", depth=1, num_classes=0)
    with pytest.raises(ValueError, match="at least 80x80"):
        model(torch.randn(1, 3, 64, 96))


def test_t5_plus_averages_ttt_and_attention():
    """With the window as large as the map, T5+ = proj(0.5 TTT + 0.5 full softmax attention on raw q, k, v)."""
    torch.manual_seed(0)
    c, heads, h = 16, 2, 3
    plus = T5TTT(c, heads, na_kernel=3).double().eval()
    plain = T5TTT(c, heads, na_kernel=0).double().eval()
    plain.load_state_dict(plus.state_dict())
    x = torch.randn(2, h * h, c, dtype=torch.float64)
    q, k, v = (t.reshape(2, h * h, heads, c // heads).transpose(1, 2) for t in plus.qkv(x).chunk(3, -1))
    sdpa = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, h * h, c)
    with torch.no_grad():
        expected = 0.5 * plain(x, (h, h)) + 0.5 * plus.proj(sdpa)
        torch.testing.assert_close(plus(x, (h, h)), expected)


def test_t5_plus_kernel_selectable():
    m5 = timm.create_model("t5_plus_tiny", depth=1, num_classes=3)
    m3 = timm.create_model("t5_plus_tiny", depth=1, num_classes=3, na_kernel=3)
    assert m5.blocks[0].attn.na_kernel == 5 and m3.blocks[0].attn.na_kernel == 3
    m3.load_state_dict(m5.state_dict())
    x = torch.randn(1, 3, 96, 80)
    with torch.no_grad():
        assert not torch.allclose(m3(x), m5(x))
    with pytest.raises(ValueError, match="odd"):
        timm.create_model("t5_plus_tiny", depth=1, na_kernel=4)


def test_inner_param_names():
    m = T5TTT(16, 2)
    assert [n for n, _ in m.ttt_parameters()] == [
        "w1", "w2", "w3", "q_conv2d.weight", "q_conv2d.bias", "k_conv2d.weight", "k_conv2d.bias"]


def test_features_only_and_pruned_norm():
    model = timm.create_model("t5_tiny", features_only=True, depth=4, img_size=32, out_indices=(1, 3)).eval()
    feats = model(torch.randn(1, 3, 32, 48))
    assert [tuple(f.shape) for f in feats] == [(1, 192, 2, 3), (1, 192, 2, 3)]
    m = T5(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3)
    m.prune_intermediate_layers(1, prune_norm=True, prune_head=True)
    assert isinstance(m.norm, torch.nn.Identity) and m.num_classes == 0


def test_grad_checkpointing_same_output():
    m = T5(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=3, na_kernel=3).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    ref = m(x)
    m.set_grad_checkpointing(True)
    out = m(x)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    assert m.blocks[0].attn.w3.grad is not None and m.pos_embed.grad is not None


@pytest.mark.parametrize("kernel,h,w,tile", [(5, 17, 23, 8), (3, 33, 8, 6), (7, 20, 11, 4), (5, 5, 5, 2)])
def test_tiled_neighborhood_attention_matches_gather_with_grads(kernel, h, w, tile):
    """The tiled NA (dilation 1) equals the per-query gather form in float64, output and gradients, on maps that
    are not multiples of the tile and smaller than one key region."""
    g = torch.Generator().manual_seed(kernel * h * w)
    q, k, v = (torch.randn(2, 3, h, w, 4, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    out = neighborhood_attention_2d_torch(q, k, v, kernel, 1, 0.5, tile=tile)
    ref = neighborhood_attention_2d_torch(q, k, v, kernel, 1, 0.5, tile=0)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w_out = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad((out * w_out).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w_out).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _smooth_maps(n, b, heads, h, w, d, dtype, seed):
    """Image-like q, k, v: a low-resolution field upsampled (neighbours correlate, peaked attention) plus noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        low = torch.randn(b * heads, d, h // 8, w // 8, generator=g, dtype=torch.float64) * 2
        up = torch.nn.functional.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)
        t = up + 0.3 * torch.randn(up.shape, generator=g, dtype=torch.float64)
        out.append(t.reshape(b, heads, d, h, w).permute(0, 1, 3, 4, 2).to(dtype))
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
def test_tiled_neighborhood_attention_fp32_bf16_at_4096_tokens(dtype, tol):
    """The default (tiled) NA in fp32 / bf16 against the float64 per-query reference at 64x64 = 4096 tokens
    (T5+ at 1024 px), head dim 64, kernel 5."""
    q, k, v = _smooth_maps(3, 1, 2, 64, 64, 64, torch.float64, seed=0)
    ref = _naive_na(*(t.flatten(2, 3) for t in (q, k, v)), 64, 64, 5, 64 ** -0.5)
    out = neighborhood_attention_2d(*(t.to(dtype) for t in (q, k, v)), 5, 1, 64 ** -0.5, use_natten=False)
    err = (out.double().flatten(2, 3) - ref).abs().max() / ref.abs().max()
    assert err < tol, f"{dtype}: max relative error {err:.3g}"


@pytest.mark.parametrize("new", [(10, 16), (20, 7), (14, 14)])
def test_pos_embed_resample_op_matches_eager(new):
    """The learned pos_embed resample as one custom op (what torch.compile runs: torch has no symbolic-size meta
    kernel for the antialiased bicubic backward) equals timm's resample, output and gradient, in float64."""
    from ttt_zoo.models._plain import _resample_eager, _resample_op
    p = torch.randn(1, 14 * 14, 8, dtype=torch.float64, requires_grad=True)
    out, ref = _resample_op(p, 14, 14, *new), _resample_eager(p, 14, 14, *new)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    g = torch.randn(out.shape, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(out, p, g)[0], torch.autograd.grad(ref, p, g)[0],
                               rtol=1e-12, atol=1e-12)
    torch.library.opcheck(_resample_op, (p.detach().float(), 14, 14, *new),
                          test_utils=("test_schema", "test_faketensor"))
