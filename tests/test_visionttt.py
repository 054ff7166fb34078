"""Vision-TTT models: parameter counts and FLOPs against the paper/spec, any input size, timm API, GMM."""
from types import SimpleNamespace

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from torch.utils.flop_counter import FlopCounterMode

import ttt_zoo
from ttt_zoo.models import VisionTTT, gradient_magnitude_map
from ttt_zoo.models.visionttt import checkpoint_filter_fn

from test_op_ttt_linear import _randomize, naive_mixer

# the paper's models, from the registry (the `_la` plain-linear-attention variants are not in the paper's tables)
HIER = [n for n in timm.list_models("visionttt_h_*") if not ttt_zoo.is_variant_model(n)]
PLAIN = [n for n in timm.list_models(module="visionttt") if n not in HIER and not ttt_zoo.is_variant_model(n)]
# spec §2.3 table (plain; the spec counts a (T+1) x D position embedding, ours is T x D: D fewer) and
# spec §2.4 variant A' (head dim 32 everywhere, biases) / variant B (head dims 32, 64, 64, 64)
SPEC_PARAMS_M = {"visionttt_tiny": 5.907, "visionttt_small": 22.444, "visionttt_base": 87.409,
                 "visionttt_h_tiny": 28.54, "visionttt_h_small": 50.11, "visionttt_h_base": 88.61}
SPEC_PARAMS_B_M = {"visionttt_h_tiny": 28.64, "visionttt_h_small": 50.33, "visionttt_h_base": 88.88}
PAPER_GFLOPS = {"visionttt_tiny": 1.44, "visionttt_small": 5.3, "visionttt_base": 20.3,
                "visionttt_h_tiny": 5.6, "visionttt_h_small": 10.8, "visionttt_h_base": 18.8}


def _meta(name, **kwargs):
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def _params_m(model):
    return sum(p.numel() for p in model.parameters()) / 1e6


def _gmacs(model, size=(224, 224)):
    """MACs in G, as the papers count them (FlopCounterMode counts 2 FLOPs per MAC); run on the meta device."""
    model = model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(torch.empty(1, 3, *size, device="meta"))
    return fc.get_total_flops() / 2e9


def test_registered_names():
    names = ttt_zoo.list_zoo_models()
    # every registered Vision-TTT model has its spec and paper numbers below
    assert sorted(PLAIN + HIER) == sorted(SPEC_PARAMS_M) == sorted(PAPER_GFLOPS)
    assert set(PLAIN + HIER) <= set(names)
    assert not [n for n in names if n.startswith(("vittt_", "h_vittt_"))]


@pytest.mark.parametrize("name", PLAIN + HIER)
def test_param_counts(name):
    assert abs(_params_m(_meta(name)) - SPEC_PARAMS_M[name]) < 0.05


@pytest.mark.parametrize("name", HIER)
def test_param_counts_head_dim_variant_b(name):
    m = _meta(name, head_dim=(32, 64, 64, 64))
    assert abs(_params_m(m) - SPEC_PARAMS_B_M[name]) < 0.05
    assert [s.blocks[0].attn.head_dim for s in m.layers] == [32, 64, 64, 64]


SLOW = pytest.mark.slow


@pytest.mark.parametrize("name", ["visionttt_tiny", "visionttt_h_tiny"] + [
    pytest.param(n, marks=SLOW) for n in ("visionttt_small", "visionttt_base", "visionttt_h_small", "visionttt_h_base")])
def test_gflops_match_paper(name):
    """With the projections run once per scan direction (as the paper counts), within 3% of the paper."""
    m = _meta(name, mixer_kwargs=dict(proj_per_direction=True))
    g = _gmacs(m)
    assert abs(g / PAPER_GFLOPS[name] - 1) < 0.03, g


def test_gflops_default_saves_the_duplicate_projections():
    """The default projects once and flips (N * D * (2D + heads) MACs per block fewer) and, with q = k, forms
    [q, 1] S once per mini-batch (2 directions x N * D * (d + 1) MACs fewer) (Vittt-T, d = 64)."""
    g_paper = _gmacs(_meta("visionttt_tiny", mixer_kwargs=dict(proj_per_direction=True)))
    g_fast = _gmacs(_meta("visionttt_tiny"))
    n, d, heads = 196, 192, 3
    assert abs((g_paper - g_fast) * 1e9 - 12 * n * d * (2 * d + heads + 2 * 65)) < 1e3


@pytest.mark.parametrize("name,size,grid", [("visionttt_tiny", (224, 320), (14, 20)),
                                            ("visionttt_h_tiny", (224, 320), (7, 10)),
                                            ("visionttt_h_tiny", (100, 150), (4, 5))])
def test_non_square_inputs(name, size, grid):
    m = timm.create_model(name, num_classes=10).eval()
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        f = m.forward_features(x)
        y = m.forward_head(f)
    assert f.shape[1:3] == grid and y.shape == (2, 10) and torch.isfinite(y).all()


def test_pos_embed_resampled_for_other_sizes():
    m = timm.create_model("visionttt_tiny", num_classes=0, depth=1).eval()
    x = torch.randn(1, 3, 160, 224)
    seen = {}
    m.blocks[0].register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    with torch.no_grad():
        m(x)
        patches = m.patch_embed(x).flatten(1, 2)
    pos = resample_abs_pos_embed(m.pos_embed, new_size=[10, 14], old_size=[14, 14], num_prefix_tokens=0)
    assert torch.allclose(seen["x"], patches + pos, atol=1e-6)


def test_bad_inputs_raise_clear_errors():
    m = timm.create_model("visionttt_tiny", depth=1)
    with pytest.raises(ValueError, match="input channels"):
        m(torch.randn(1, 1, 224, 224))
    with pytest.raises(ValueError, match="divisible by its patch size"):
        m(torch.randn(1, 3, 200, 224))
    with pytest.raises(TypeError):
        timm.create_model("visionttt_tiny", not_an_option=1)
    with pytest.raises(ValueError, match="head_dim"):
        timm.create_model("visionttt_h_tiny", head_dim=(32, 64))


def test_features_and_intermediates():
    m = timm.create_model("visionttt_h_tiny", features_only=True, depths=(1, 1, 1, 1)).eval()
    with torch.no_grad():
        feats = m(torch.randn(1, 3, 96, 128))
    assert [tuple(f.shape[1:]) for f in feats] == [(96, 24, 32), (192, 12, 16), (384, 6, 8), (768, 3, 4)]
    m = timm.create_model("visionttt_tiny", depth=4).eval()
    with torch.no_grad():
        out, inter = m.forward_intermediates(torch.randn(1, 3, 64, 96), indices=2)
    assert out.shape == (1, 4, 6, 192) and [tuple(t.shape) for t in inter] == [(1, 192, 4, 6)] * 2


def test_checkpoint_filter_resamples_pos_embed():
    src = timm.create_model("visionttt_tiny", depth=1, img_size=160)
    sd = dict(src.state_dict())
    sd["pos_embed"] = torch.cat([torch.zeros(1, 1, 192), sd["pos_embed"]], 1)  # a (T+1) x D embedding
    dst = timm.create_model("visionttt_tiny", depth=1)
    out = checkpoint_filter_fn(sd, dst)
    assert out["pos_embed"].shape == dst.pos_embed.shape
    dst.load_state_dict(out)
    bad = dict(out)
    bad["blocks.0.attn.w0"] = torch.zeros(1, 2, 64, 64)
    with pytest.raises(ValueError, match="w0"):
        checkpoint_filter_fn(bad, dst)


@pytest.mark.parametrize("direction", ["forth", "back", "sum"])
def test_gradient_magnitude_map_matches_autograd(direction):
    """Eq. 6: ||grad_W l_t||_F per token of one block, checked against per-token autograd (naive scan)."""
    m = VisionTTT(img_size=(48, 80), patch_size=16, embed_dim=64, depth=2, head_dim=32, num_classes=0,
                  mixer_kwargs=dict(mini_batch=4, base_lr=8.0)).double().eval()
    _randomize(m.blocks[1].attn, seed=5)
    x = torch.randn(2, 3, 48, 80, dtype=torch.float64)
    gmm = gradient_magnitude_map(m, x, block=1, direction=direction)
    assert gmm.shape == (2, 3, 5)
    seen = {}
    m.blocks[1].attn.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    with torch.no_grad():
        m(x)
    _, norms = naive_mixer(m.blocks[1].attn, seen["x"], (3, 5), return_norms=True)  # (2 dirs, B, heads, N)
    per_dir = norms.pow(2).sum(2).sqrt()
    ref = {"forth": per_dir[0], "back": per_dir[1], "sum": per_dir.sum(0)}[direction]
    assert torch.allclose(gmm.flatten(1), ref, rtol=1e-9, atol=1e-12)
    assert ref.std() > 0  # tokens differ


@pytest.mark.parametrize("name,kwargs", [("visionttt_tiny", dict(depth=2)),
                                         ("visionttt_h_tiny", dict(depths=(1, 1, 1, 1), embed_dim=32))])
def test_torchscript_and_fx_match_eager(name, kwargs):
    """The scripted model (which compiles the reference scan) and the fx-traced one (scan as a leaf) give the
    eager numbers; 64 x 80 px leaves partial mini-batches in both directions."""
    from torchvision.models.feature_extraction import create_feature_extractor
    m = timm.create_model(name, num_classes=10, **kwargs).eval()
    for mod in m.modules():
        if type(mod).__name__ == "TTTLinearMixer":
            _randomize(mod, seed=7)  # inner updates that matter
    x = torch.randn(2, 3, 64, 80)
    scripted = torch.jit.script(m)
    fx = create_feature_extractor(m, return_nodes=["head"], tracer_kwargs=dict(
        leaf_modules=timm.models.get_notrace_modules(), autowrap_functions=timm.models.get_notrace_functions()))
    with torch.no_grad():
        ref = m(x)
        assert (scripted(x) - ref).abs().max().item() < 1e-5
        assert (fx(x)["head"] - ref).abs().max().item() < 1e-5
        frozen = m.forward_head(m.forward_features(x))
    assert (frozen - ref).abs().max().item() == 0
    # with grad enabled (no in-place state update) the scripted model gives the same output and gradients
    xg = x.clone().requires_grad_()
    ys = scripted(xg)
    gs, = torch.autograd.grad(ys.square().sum(), xg)
    ye = m(xg)
    ge, = torch.autograd.grad(ye.square().sum(), xg)
    assert (ys - ref).abs().max().item() < 1e-5 and (ye - ref).abs().max().item() < 1e-5
    assert (gs - ge).abs().max().item() < 1e-5 * ge.abs().max().item()


@pytest.mark.parametrize("n, shared, ln_residual", [(1030, True, True), (196, False, True), (1024, True, False)])
def test_loop_op_scan_equals_plain_scan(monkeypatch, n, shared, ln_residual):
    # the export path (one `scan` loop op over zero-lr-padded mini-batches) against the plain per-mini-batch scan,
    # float64, N in the thousands and not a multiple of the mini-batch
    from ttt_zoo.kernels.ttt_linear import naive as scan_lib
    from ttt_zoo.kernels.ttt_linear import token_tau, torch as scan_rc
    g = torch.Generator().manual_seed(n)
    b, h, d, mb = 2, 3, 16, 16
    f64 = dict(dtype=torch.float64)
    q = torch.randn(b, h, n, d, generator=g, **f64) / d ** 0.5
    k = q if shared else torch.randn(b, h, n, d, generator=g, **f64) / d ** 0.5
    v = torch.randn(b, h, n, d, generator=g, **f64)
    lr = torch.rand(b, h, n, generator=g, **f64) / d
    tau = token_tau(0.1 * torch.randn(mb, generator=g, **f64))
    w0, b0 = 0.1 * torch.randn(1, h, d, d, generator=g, **f64), 0.1 * torch.randn(1, h, 1, d, generator=g, **f64)
    ln_w, ln_b = 1 + 0.1 * torch.randn(h, d, generator=g, **f64), 0.1 * torch.randn(h, d, generator=g, **f64)
    ref, _ = scan_lib.ttt_linear_naive(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    out, _ = scan_rc.ttt_linear_chunked(q, k, v, lr, tau, w0, b0, ln_w, ln_b, mb, ln_residual)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 1e-10 * ref.abs().max()


# ------------------------------------------------------------------------ the mixer's glue (issue 48)
def test_scaled_tau_is_the_scale_times_token_tau():
    """The scan gets ``scale * tau`` (the lr scale folded into the 16 position factors): the scale times
    ``token_tau`` in value and gradient, offsets on both sides of the ReLU's kink (1/i + offset_i = 0) and, for a
    power-of-two scale (base_lr / d), exactly, kinks included."""
    from ttt_zoo.kernels import token_tau
    from ttt_zoo.layers import TTTLinearMixer
    m = TTTLinearMixer(16, head_dim=8, mini_batch=8).double()
    g = torch.randn(8, dtype=torch.float64)
    off_kinks = [-1.5, -0.4, 0.0, 0.3, -0.2, -0.3, 1.0, -0.125]  # 1/i + offset < 0 at i = 1, 6; = 0 at i = 5, 8
    off_plain = [-1.5, -0.4, 0.0, 0.3, -0.19, -0.3, 1.0, -0.13]
    for offsets, scales, tol in ((off_kinks, (1 / 64, 1 / 32, 4.0), 0.0), (off_plain, (0.37, 3.0, 0.0), 1e-14)):
        with torch.no_grad():
            m.tau_offset.copy_(torch.tensor(offsets, dtype=torch.float64))
        for scale in scales:
            ours = m._scaled_tau(scale)
            (d_ours,) = torch.autograd.grad((ours * g).sum(), m.tau_offset)
            ref = scale * token_tau(m.tau_offset)
            (d_ref,) = torch.autograd.grad((ref * g).sum(), m.tau_offset)
            torch.testing.assert_close(ours, ref, rtol=tol, atol=0)
            torch.testing.assert_close(d_ours, d_ref, rtol=tol, atol=0)
            assert (ours[[0, 5]] == 0).all() and (d_ours[[0, 5]] == 0).all()
            assert tol or ((ours[[4, 7]] == 0).all() and (d_ours[[4, 7]] == 0).all())


class _WithZeroProjBias:
    """The mixer as naive_mixer reads it, with a zero bias in place of proj's None."""

    def __init__(self, m):
        self._m = m
        self.proj = SimpleNamespace(weight=m.proj.weight, bias=torch.zeros(3 * m.dim, dtype=m.proj.weight.dtype))

    def __getattr__(self, name):
        return getattr(self._m, name)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_training_path_matches_naive_and_gradcheck(qkv_bias):
    """Training takes the one-GEMM q/k/gate/v/lr projection and the scaled tau, at a base_lr whose scale
    base_lr / d is not a power of two: output against the mixer written out with the naive scan (float64), the
    gradients of the input and of the parameters the glue touches against finite differences (gradcheck)."""
    from torch.func import functional_call
    from ttt_zoo.layers import create_mixer
    m = create_mixer("ttt_linear", 8, head_dim=4, mini_batch=4, base_lr=0.37, qkv_bias=qkv_bias,
                     backend="torch").double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    x = torch.randn(2, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert m._fuse_projections(x)
    ref = naive_mixer(m if qkv_bias else _WithZeroProjBias(m), x, (3, 4))
    assert (m(x, (3, 4)) - ref).abs().max().item() < 1e-12 * ref.abs().max().item()
    names = ["tau_offset", "lr_proj.weight", "lr_proj.bias", "proj.weight"] + (["proj.bias"] if qkv_bias else [])
    params = dict(m.named_parameters())
    rest = {n: p.detach() for n, p in params.items() if n not in names}

    def run(x, *ps):
        return functional_call(m, {**rest, **dict(zip(names, ps))}, (x, (3, 4)))
    assert torch.autograd.gradcheck(run, (x, *[params[n].detach().requires_grad_() for n in names]), fast_mode=True)
