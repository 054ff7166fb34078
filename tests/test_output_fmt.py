"""Every image model declares its ``forward_features`` layout the timm way (``output_fmt``, as Swin / ConvNeXt) and
returns that layout; ``features_only`` maps stay NCHW whatever the layout (docs/models.md, "forward_features
layout").  Models are built one block per stage (the family's ``ONE_BLOCK_KWARGS``) at a narrow width."""
import pytest
import timm
import torch

import ttt_zoo
from ttt_zoo.bench.compile import SMALL

#: narrow widths per family (on top of its one-block overrides)
NARROW = {
    "vit3": dict(embed_dim=64, num_heads=2), "t5": dict(embed_dim=64, num_heads=2),
    "t5_plus": dict(embed_dim=64, num_heads=2), "visionttt": dict(embed_dim=64, head_dim=32),
    "hvit3": dict(embed_dim=(32, 64), num_heads=(1, 2)), "visionttt_h": dict(embed_dim=32),
}
IMAGE = (96, 128)  # not square (H and W must not swap); >= 80 px for T5+ (patch 16 x 5x5 neighbourhood)
EXPECTED_FMT = {"vit3": "NHWC", "t5": "NHWC", "t5_plus": "NHWC", "visionttt": "NHWC", "visionttt_h": "NHWC",
                "hvit3": "NCHW"}


def _family(name):
    """The longest family whose name prefixes the model's (``visionttt_h_tiny`` -> ``visionttt_h``)."""
    return max((f for f in NARROW if name.startswith(f + "_")), key=len)


def _small(name, **kwargs):
    family = _family(name)
    torch.manual_seed(0)
    return timm.create_model(name, **dict(SMALL[family], **NARROW[family]), **kwargs).eval()


def test_every_image_family_is_covered():
    families = set(ttt_zoo.list_zoo_families())
    assert families == set(NARROW) == set(EXPECTED_FMT), "a new image family needs its NARROW / EXPECTED_FMT row"
    assert set(NARROW) <= set(SMALL)


@pytest.mark.parametrize("name", ttt_zoo.list_zoo_models())
def test_forward_features_has_the_declared_layout(name):
    model = _small(name)
    assert model.output_fmt == EXPECTED_FMT[_family(name)], name
    stride = model.feature_info[-1]["reduction"]
    h, w = IMAGE[0] // stride, IMAGE[1] // stride
    with torch.no_grad():
        feats = model.forward_features(torch.randn(2, 3, *IMAGE))
        logits = model.forward_head(feats)
    expected = (2, h, w, model.num_features) if model.output_fmt == "NHWC" else (2, model.num_features, h, w)
    assert tuple(feats.shape) == expected, (name, model.output_fmt, tuple(feats.shape))
    assert tuple(logits.shape) == (2, model.num_classes)


@pytest.mark.parametrize("family,name", sorted(ttt_zoo.list_zoo_families().items()))
def test_features_only_maps_are_nchw(family, name):
    hierarchical = "depths" in SMALL[family]  # two stages of one block, or one block
    model = _small(name, features_only=True, out_indices=(0, 1) if hierarchical else (0,))
    with torch.no_grad():
        maps = model(torch.randn(1, 3, *IMAGE))
    assert [m.shape[1] for m in maps] == model.feature_info.channels()
    assert [(m.shape[2], m.shape[3]) for m in maps] == [(IMAGE[0] // r, IMAGE[1] // r)
                                                        for r in model.feature_info.reduction()]
