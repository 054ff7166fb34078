"""ViT3 / H-ViT3 models: exact sizes, FLOPs vs the paper, any input size, the timm API, bad input."""
import sys

import pytest
import timm
import torch

import ttt_zoo
from ttt_zoo.cli.list import model_stats

PAPER = {  # exact official parameter counts (spec §2, §3) and the papers' GFLOPs at 224
    "vit3_tiny": (6_149_416, 1.2), "vit3_small": (23_799_400, 4.8), "vit3_base": (90_055_912, 18.0),
    "hvit3_tiny": (28_703_560, 4.9), "hvit3_small": (54_362_056, 8.8), "hvit3_base": (94_369_304, 16.7),
}


def _tiny(name, **kw):
    if name.startswith("vit3"):
        return timm.create_model("vit3_tiny", depth=2, **kw)
    return timm.create_model("hvit3_tiny", embed_dim=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 2), **kw)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_exact_params_and_gflops_within_5pct(name):
    stats = model_stats(name, 224)
    params, gflops = PAPER[name]
    assert stats["params"] == params
    assert abs(stats["gflops"] - gflops) / gflops < 0.05, stats


def test_registered_and_listed():
    # every registered ViT3 / H-ViT3 model has its paper numbers above
    ours = set(timm.list_models(module="vit3")) | set(timm.list_models(module="hvit3"))
    assert set(PAPER) == {n for n in ours if not ttt_zoo.is_variant_model(n)}
    assert set(PAPER) <= set(ttt_zoo.list_zoo_models())
    assert not any(n.startswith(("vittt_", "h_vittt_")) for n in ttt_zoo.list_zoo_models())


@pytest.mark.parametrize("name,size", [("vit3", (224, 320)), ("vit3", (64, 48)), ("hvit3", (224, 320)),
                                       ("hvit3", (70, 45)), ("hvit3", (33, 97))])
def test_non_square_inputs(name, size):
    model = _tiny(name, num_classes=7).eval()
    x = torch.randn(2, 3, *size)
    out = model(x)
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    feats = model.forward_features(x)
    if name == "vit3":
        assert feats.shape == (2, size[0] // 16, size[1] // 16, 192)
    else:
        assert feats.shape[-2:] == (-(-size[0] // 32), -(-size[1] // 32))


@pytest.mark.slow
@pytest.mark.parametrize("name,size", [("vit3_tiny", (512, 1024)), ("hvit3_tiny", (800, 1333))])
def test_full_models_at_large_non_square_sizes(name, size):
    model = timm.create_model(name, features_only=True).eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, *size))
    for o, r in zip(outs, model.feature_info.reduction()):
        assert o.shape[-2:] == (-(-size[0] // r), -(-size[1] // r))


def test_hvit3_features_only_four_levels():
    model = _tiny("hvit3", features_only=True).eval()
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    assert model.feature_info.channels() == [16, 32, 48, 64]
    outs = model(torch.randn(1, 3, 96, 160))
    assert [tuple(o.shape[-2:]) for o in outs] == [(24, 40), (12, 20), (6, 10), (3, 5)]


def test_vit3_features_from_chosen_blocks():
    model = timm.create_model("vit3_tiny", depth=4, features_only=True, out_indices=(1, 3)).eval()
    outs = model(torch.randn(1, 3, 64, 96))
    assert model.feature_info.reduction() == [16, 16]
    assert [tuple(o.shape) for o in outs] == [(1, 192, 4, 6)] * 2


@pytest.mark.parametrize("name", ["vit3", "hvit3"])
def test_intermediates_checkpointing_and_heads(name):
    model = _tiny(name, num_classes=5).eval()
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    final, inter = model.forward_intermediates(x)
    torch.testing.assert_close(final, feats)
    only = model.forward_intermediates(x, indices=[0], intermediates_only=True)
    torch.testing.assert_close(only[0], inter[0])
    logits = model(x)
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(model(x), logits)
    pooled = model.forward_head(feats, pre_logits=True)
    model.reset_classifier(0)
    torch.testing.assert_close(model(x), pooled)
    model.reset_classifier(3, global_pool="")
    assert model(x).dim() == 4


def test_grad_checkpointing_gives_same_gradients():
    model = _tiny("hvit3", num_classes=3).double().train()
    x = torch.randn(2, 3, 40, 56, dtype=torch.float64)
    model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("name", ["vit3", "hvit3"])
def test_bf16_and_meta(name):
    model = _tiny(name).eval()
    x = torch.randn(1, 3, 64, 64)
    ref = model(x)
    out = model.to(torch.bfloat16)(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.nn.functional.cosine_similarity(out.float(), ref, dim=-1).min() > 0.99
    with torch.device("meta"):
        m = _tiny(name)
        assert m(torch.empty(1, 3, 64, 96)).shape == (1, 1000)


def test_bad_inputs_have_clear_errors():
    vit, hvit = _tiny("vit3").eval(), _tiny("hvit3").eval()
    with pytest.raises(ValueError, match="3 input channels but got 1.*in_chans=1"):
        vit(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match="3 input channels but got 4"):
        hvit(torch.randn(1, 4, 64, 64))
    with pytest.raises(ValueError, match="divisible by its patch size 16, got 64x70.*64x80"):
        vit(torch.randn(1, 3, 64, 70))
    with pytest.raises(ValueError, match="at least 16x16"):
        vit(torch.randn(1, 3, 8, 32))
    with pytest.raises(ValueError, match="4-D image batch"):
        hvit(torch.randn(3, 64, 64))
    with pytest.raises(ValueError, match="Did you mean 'vit3_tiny'"):
        ttt_zoo.create_model("vit3_tinyy")


@pytest.mark.parametrize("family", sorted(ttt_zoo.list_zoo_families(include_diffusion=True)))
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_integer_images_say_a_float_image_is_expected(family, dtype):
    """Every family (diffusion latents too) refuses an integer tensor before any layer sees it, saying how to fix it."""
    name = ttt_zoo.list_zoo_families(include_diffusion=True)[family]
    with torch.device("meta"):
        model = timm.create_model(name).eval()
    x = torch.zeros(2, model.in_chans, 64, 64, dtype=dtype)
    args = (x, torch.zeros(2), torch.zeros(2, dtype=torch.long)) if ttt_zoo.is_diffusion_model(name) else (x,)
    with pytest.raises(TypeError, match=r"expects a floating-point image batch.*x\.float\(\) / 255.*mean and std"):
        model(*args)


def test_torch_hub_local(tmp_path):
    import os
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model = torch.hub.load(repo, "hvit3_tiny", source="local", pretrained=False, num_classes=3,
                           embed_dim=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 2))
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)
    with pytest.raises(ValueError, match="Did you mean"):
        torch.hub.load(repo, "create_model", "hvit3_tinny", source="local")


def test_cli_list(capsys):
    from ttt_zoo.cli import main
    assert main(["list", "--filter", "vit3_tiny"]) == 0
    out = capsys.readouterr().out
    assert "vit3_tiny" in out and "6.149" in out
