"""Attention maps: the implicit score dO_i/dV_j (T5 paper Eq. 13) through the mixer's own code equals the one
through its linear-attention form; it equals the explicit map q_hat_i . k_hat_j (with gates) exactly where the
form's q_hat, k_hat, gates and normaliser do not depend on v, and differs where they do; softmax attention gives
its attention weights; the ``ttt-zoo attention-map`` command writes the PNG."""
import os

import pytest
import torch
import torch.nn.functional as F

from ttt_zoo.analysis import explicit_attention_map, implicit_attention_map
from ttt_zoo.layers import DiT5MixedAttention, SoftmaxAttention, T5TTT, TTTLinearMixer, ViT3TTT

from test_linear_attention import FS, MIXERS, _random, _x

TOL = 1e-10
QUERIES = [0, 17, (5, 6)]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(MIXERS))
def test_implicit_map_mixer_equals_form(name):
    """Two independent routes to dO_i/dV_j: hooks in the mixer's own forward (ViT3: its inner-step ops on an
    explicit v) and the linear-attention form (one-VJP probes: every VJP must agree; the trace is their sum)."""
    m, x = _random(name), _x()
    a = implicit_attention_map(m, x, FS, QUERIES, via="mixer", reduce="probe")
    b = implicit_attention_map(m, x, FS, QUERIES, via="form", reduce="probe")
    assert a.shape == (2, len(QUERIES), m.num_heads + isinstance(m, ViT3TTT), FS[0] * FS[1])
    assert _rel(a, b) <= TOL
    if name in ("vit3", "t5_plus", "visionttt"):
        a = implicit_attention_map(m, x, FS, [17], via="mixer")
        assert _rel(a, implicit_attention_map(m, x, FS, [17], via="form")) <= TOL


def _zeroed(name, param):
    m = _random(name)
    with torch.no_grad():
        getattr(m, param).zero_()
    return m


# Where the explicit map is the whole Jacobian: the step of every non-last inner layer vanishes identically
# (its gradient carries a factor of the zeroed weight), no gradient normalisation, and for Vision-TTT a single
# mini-batch without the inner LayerNorm (then z_bar is linear in v with weights tau_i lr_j q_i . k_j).
EXACT = {
    "vit3, no normalize_grad, w1 = 0 (static gate; conv head too)": lambda: _zeroed("vit3_no_norm", "w1"),
    "vit3 rope, no normalize_grad, w1 = 0": lambda: _zeroed("vit3_rope_no_norm", "w1"),
    "t5, w3 = 0": lambda: _zeroed("t5", "w3"),
    "t5+, w3 = 0 (with the NA half)": lambda: _zeroed("t5_plus", "w3"),
    "dit5, w2 = 0 (with the NA half)": lambda: _zeroed("dit5", "w2"),
    "visionttt, one mini-batch, no inner LN": lambda: _random_visionttt_one_batch(),
}


def _random_visionttt_one_batch():
    torch.manual_seed(0)
    m = TTTLinearMixer(32, head_dim=8, mini_batch=FS[0] * FS[1], inner_ln_residual=False)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m.double().eval()


@pytest.mark.parametrize("case", list(EXACT))
def test_explicit_equals_implicit_where_exact(case):
    m, x = EXACT[case](), _x()
    imp = implicit_attention_map(m, x, FS, QUERIES[1:])
    exp = explicit_attention_map(m, x, FS, QUERIES[1:])
    assert _rel(exp, imp) <= TOL, f"{case}: {_rel(exp, imp):.2e}"
    # the Jacobian is diagonal per head here, so the one-VJP probe is exact too
    assert _rel(implicit_attention_map(m, x, FS, QUERIES[1:], reduce="probe", seed=3), imp) <= TOL
    # negative control: another query's explicit map is not this one's implicit map
    assert _rel(explicit_attention_map(m, x, FS, [18, (5, 5)]), imp) > 1e-3


# Where the explicit map is only part of the Jacobian (the dynamic gate W2' / W1', W2' / the normaliser / the
# inner LayerNorm and the delta-rule chain across mini-batches all depend on v): the maps must differ.
INEXACT = ["vit3", "vit3_no_norm", "t5", "dit5", "visionttt"]


@pytest.mark.parametrize("name", INEXACT)
def test_explicit_differs_where_v_moves_the_kernel(name):
    m, x = _random(name), _x()
    imp = implicit_attention_map(m, x, FS, [17])
    exp = explicit_attention_map(m, x, FS, [17])
    assert _rel(exp, imp) > 1e-3
    probe = implicit_attention_map(m, x, FS, [17], reduce="probe")
    if name.startswith("vit3"):
        # ViT3's Jacobian is diagonal per channel (column c of W1's and W2's steps and of the normaliser sees only
        # value channel c): the probe is exact; the explicit map misses the diagonal's gate/normaliser terms
        assert _rel(probe, imp) <= TOL
    else:  # T5's w3, DiT5's w2 and Vision-TTT's LayerNorms mix channels: the probe only estimates the trace
        assert _rel(probe, imp) > 1e-6


def test_softmax_implicit_map_is_the_attention_matrix():
    torch.manual_seed(0)
    m = SoftmaxAttention(32, 4).double().eval()
    x = _x()
    imp = implicit_attention_map(m, x, FS, QUERIES)
    assert _rel(implicit_attention_map(m, x, FS, QUERIES, reduce="probe"), imp) <= TOL
    q, k, _ = m.qkv(x).reshape(2, -1, 3, 4, 8).permute(2, 0, 3, 1, 4)
    attn = ((q @ k.transpose(-2, -1)) * 8 ** -0.5).softmax(-1).detach()  # (B, heads, N, N)
    idx = [0, 17, 5 * FS[1] + 6]
    assert _rel(imp, attn[:, :, idx].transpose(1, 2)) <= TOL


def test_bad_queries_and_via():
    m, x = _random("t5"), _x()
    with pytest.raises(ValueError, match="outside the 6 x 7 feature map"):
        implicit_attention_map(m, x, FS, [(6, 0)])
    with pytest.raises(ValueError, match="via must be"):
        implicit_attention_map(m, x, FS, [0], via="autograd")
    with pytest.raises(ValueError, match="reduce must be"):
        implicit_attention_map(m, x, FS, [0], reduce="sum")


def test_visionttt_map_is_not_blind_to_layernorm():
    """Vision-TTT's o = Z passes through LayerNorms (inner LN residual): an all-ones probe would give 0 to rounding;
    the trace does not, and the query's own token dominates at init (the residual path)."""
    m, x = _random("visionttt", std=0.02), _x()
    imp = implicit_attention_map(m, x, FS, [17])
    assert imp.abs().max() > 1e-3
    assert int(imp[0, 0].abs().sum(0).argmax()) == 17


def test_cli_writes_png(tmp_path):
    from PIL import Image
    from ttt_zoo.cli import main
    from ttt_zoo.cli.demo import ASSET_IMAGE
    out = tmp_path / "map.png"
    assert main(["attention-map", "--model", "vit3_tiny", "--image", ASSET_IMAGE, "--query-pixel", "150", "200",
                 "--layer", "0", "-1", "--img-size", "96", "--out", str(out)]) == 0
    with Image.open(out) as im:
        assert im.format == "PNG" and im.width > im.height > 100
    with pytest.raises(SystemExit, match="outside the"):
        main(["attention-map", "--model", "vit3_tiny", "--query-pixel", "5000", "0", "--out", str(tmp_path / "b.png")])
    assert not os.path.exists(tmp_path / "b.png")


def test_cli_checkpoint_with_model_kwargs(tmp_path):
    # a checkpoint of a non-default configuration (as `ttt-zoo train --model-kwargs` writes it) loads with the same
    # --model-kwargs, and without them fails with a message naming the flag
    import timm
    from safetensors.torch import save_file
    from ttt_zoo.cli import main
    from ttt_zoo.cli.demo import ASSET_IMAGE
    kw = dict(patch_size=8, embed_dim=48, depth=2, num_heads=2, num_classes=10)
    ckpt = tmp_path / "best.safetensors"
    save_file(timm.create_model("vit3_tiny", **kw).state_dict(), str(ckpt))
    out = tmp_path / "map.png"
    assert main(["attention-map", "--model", "vit3_tiny", "--checkpoint", str(ckpt), "--model-kwargs",
                 *(f"{k}={v}" for k, v in kw.items() if k != "num_classes"), "--img-size", "64",
                 "--image", ASSET_IMAGE, "--query-pixel", "150", "200", "--out", str(out)]) == 0
    assert out.is_file()
    with pytest.raises(SystemExit, match="--model-kwargs"):
        main(["attention-map", "--model", "vit3_tiny", "--checkpoint", str(ckpt), "--query-pixel", "150", "200",
              "--out", str(tmp_path / "b.png")])


def test_image_maps_layers_and_errors():
    from ttt_zoo.analysis import image_attention_maps
    from ttt_zoo.models import T5
    torch.manual_seed(0)
    model = T5(img_size=32, patch_size=4, embed_dim=32, depth=3, num_heads=2, num_classes=10).eval()
    img = torch.randn(1, 3, 32, 32)
    maps = image_attention_maps(model, img, (31, 0), layers=[0, -1])
    assert [m["layer"] for m in maps] == [0, 2] and maps[0]["query"] == (7, 0)
    assert maps[0]["map"].shape == (2, 8, 8) and maps[0]["map"].dtype == torch.float64
    with pytest.raises(ValueError, match="out of range: the model has 3 mixers"):
        image_attention_maps(model, img, (0, 0), layers=[3])
    with pytest.raises(ValueError, match="outside the 32 x 32 image"):
        image_attention_maps(model, img, (32, 0))


# --------------------------------------------------- every variant option: the maps go through the mixer's form
from test_linear_attention import VARIANTS, VFS, perturbed_variant  # noqa: E402


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_maps(name):
    """Each variant's implicit map through its own code equals the one through its form, and its explicit map
    (from its form) has the same shape; where q_hat, k_hat and the gates do not depend on v (V6: o = q (w1 + s k^T
    v); the dot-loss Vision-TTT: z_bar linear in v) the explicit map is the implicit one."""
    m = perturbed_variant(name)
    x = torch.randn(1, VFS[0] * VFS[1], 16, dtype=torch.float64)
    if getattr(m, "proj_per_direction", False):  # its backward v is projected outside proj: form only
        with pytest.raises(ValueError, match="use via='form'"):
            implicit_attention_map(m, x, VFS, [9], via="mixer")
        m.proj_per_direction = False  # the same outputs
    a = implicit_attention_map(m, x, VFS, [9, (7, 6)], via="mixer", reduce="probe")
    b = implicit_attention_map(m, x, VFS, [9, (7, 6)], via="form", reduce="probe")
    assert _rel(a, b) <= TOL
    exp = explicit_attention_map(m, x, VFS, [9, (7, 6)])
    assert exp.shape == a.shape and torch.isfinite(exp).all()
    if name in ("vit3_v6", "visionttt_la"):
        assert _rel(exp, implicit_attention_map(m, x, VFS, [9, (7, 6)])) <= TOL


def test_softmax_has_no_explicit_map():
    m = SoftmaxAttention(32, 4).double().eval()
    with pytest.raises(NotImplementedError, match="SoftmaxAttention has no exact linear-attention form"):
        explicit_attention_map(m, _x(), FS, [0])
    with pytest.raises(NotImplementedError, match="SoftmaxAttention has no exact linear-attention form"):
        implicit_attention_map(m, _x(), FS, [0], via="form")


@pytest.mark.parametrize("model,extra", [("vit3_tiny_v3", []), ("vit3_tiny_v1", ["--map", "explicit"]),
                                         ("visionttt_tiny_la", ["--via", "form"])])
def test_cli_variant_models(tmp_path, model, extra):
    """The issue's crashes: ``attention-map --model vit3_tiny_v3`` (implicit map), and V1 / Vision-TTT-LA's forms."""
    from ttt_zoo.cli import main
    from ttt_zoo.cli.demo import ASSET_IMAGE
    out = tmp_path / "map.png"
    kw = ["--model-kwargs", "embed_dim=32", "depth=1", "num_heads=2"] if model.startswith("vit3") else \
        ["--model-kwargs", "embed_dim=32", "depth=1", "head_dim=16"]
    assert main(["attention-map", "--model", model, *kw, "--image", ASSET_IMAGE, "--query-pixel", "40", "50",
                 "--img-size", "64", "--out", str(out), *extra]) == 0
    assert out.is_file()


def test_plot_keeps_the_aspect_ratio_and_draws_a_colour_bar(tmp_path, monkeypatch):
    # the model sees a square resize; the panels show the photo at its own aspect ratio, with a colour bar
    import matplotlib.figure
    from PIL import Image
    from ttt_zoo.cli.attention_map import plot_maps
    bars = []
    real_colorbar = matplotlib.figure.Figure.colorbar
    monkeypatch.setattr(matplotlib.figure.Figure, "colorbar",
                        lambda self, *a, **k: bars.append(k.get("label")) or real_colorbar(self, *a, **k))
    rgb = torch.rand(32, 32, 3).numpy()
    maps = [dict(map=torch.rand(2, 4, 4), layer=0, feat_size=(4, 4)), dict(map=torch.rand(2, 4, 4), layer=1,
                                                                              feat_size=(4, 4))]
    sizes = {}
    for name, orig in (("wide", (100, 300)), ("tall", (300, 100))):
        plot_maps(rgb, (50, 50), maps, str(tmp_path / f"{name}.png"), "t", orig_size=orig)
        with Image.open(tmp_path / f"{name}.png") as im:
            sizes[name] = im.width / im.height
    assert sizes["wide"] > 2.0 * sizes["tall"]
    assert bars == ["|A| / max |A| (per layer)"] * 2
