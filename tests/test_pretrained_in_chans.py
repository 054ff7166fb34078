"""pretrained=True with another in_chans and any num_classes, as timm's own models load (issue 30, item 7).

timm's ``load_pretrained`` adapts the cfg's ``first_conv`` with ``adapt_input_conv`` and drops the ``classifier``
when ``num_classes`` differs; our filter's checks must let it.  The families come from the timm registry: one
model (the smallest) per model class of every ttt_zoo module with a classifier, so a new family is tested too."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never download

import pytest  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from timm.models import adapt_input_conv, get_model_input_config  # noqa: E402
from torch import nn  # noqa: E402

from ttt_zoo.models import MODEL_MODULES  # noqa: E402


def _first_convs(cfg):
    convs = cfg.get("first_conv")
    return (convs,) if isinstance(convs, str) else tuple(convs or ())


def _registered_classifiers():
    """{name: meta-device model} of every registered ttt_zoo model whose cfg names a classifier."""
    models = {}
    for module in MODEL_MODULES:
        for name in timm.list_models(module=module):
            if timm.models.get_pretrained_cfg(name).classifier:
                models[name] = (module, timm.create_model(name, device="meta"))
    return models


def _small_kwargs(model):
    """One block per stage (keeps the widths, so every module exists)."""
    stages_attr = getattr(model, "stages_attr", None)  # TTTClassifier's: plain "blocks", hierarchical "layers"
    if stages_attr == "blocks":
        return dict(depth=1)
    if stages_attr == "layers":
        return dict(depths=(1,) * len(model.layers))
    return {}


def _families():
    """The smallest model of each (module, model class), with its small kwargs."""
    best = {}
    for name, (module, model) in _registered_classifiers().items():
        key = (module, type(model).__name__)
        size = sum(p.numel() for p in model.parameters())
        if key not in best or size < best[key][0]:
            best[key] = (size, name, _small_kwargs(model))
    return [pytest.param(name, kw, id=f"{module}.{cls}:{name}")
            for (module, cls), (_, name, kw) in sorted(best.items())]


_CLASSIFIERS = _registered_classifiers()
FAMILIES = _families()


def test_registry_has_classifier_families():
    assert len(FAMILIES) >= 5, FAMILIES  # ViT3, H-ViT3, T5, Vision-TTT, Vision-TTT-H at least


@pytest.mark.parametrize("name", sorted(_CLASSIFIERS))
def test_first_conv_names_the_input_conv(name):
    """Every classifier's cfg names its real input conv (what timm adapts), and the classifier its head."""
    _, model = _CLASSIFIERS[name]
    cfg = model.pretrained_cfg
    convs = _first_convs(cfg)
    assert convs, f"{name}: pretrained_cfg has no first_conv"
    for conv in convs:
        module = model.get_submodule(conv)
        assert isinstance(module, nn.Conv2d) and module.in_channels == model.in_chans, (name, conv, module)
    assert model.get_submodule(cfg["classifier"]) is model.get_classifier()


@pytest.fixture(scope="module")
def saved_sources(tmp_path_factory):
    """name -> (path of its model.safetensors, its state dict), written once per family."""
    cache = {}

    def get(name, kwargs):
        if name not in cache:
            torch.manual_seed(0)
            src = timm.create_model(name, **kwargs)
            with torch.no_grad():  # every tensor unlike a fresh init (variances stay positive)
                for v in src.state_dict().values():
                    if v.is_floating_point():
                        v.add_(torch.rand_like(v), alpha=0.01)
            sd = {k: v.clone().contiguous() for k, v in src.state_dict().items()}
            path = tmp_path_factory.mktemp(name) / "model.safetensors"
            save_file(sd, str(path))
            cache[name] = (str(path), sd)
        return cache[name]
    return get


@pytest.mark.parametrize("in_chans,num_classes", [(1, 5), (4, 0), (3, 1000)])
@pytest.mark.parametrize("name,kwargs", FAMILIES)
def test_pretrained_loads_with_other_in_chans_and_num_classes(saved_sources, name, kwargs, in_chans, num_classes):
    path, src = saved_sources(name, kwargs)
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path), in_chans=in_chans,
                              num_classes=num_classes, **kwargs).eval()
    cfg = model.pretrained_cfg
    stems = {f"{c}.weight" for c in _first_convs(cfg)}
    head = f"{cfg['classifier']}."
    own = model.state_dict()

    for key in stems:
        expected = adapt_input_conv(in_chans, src[key])
        assert own[key].shape[1] == in_chans
        torch.testing.assert_close(own[key], expected, rtol=0, atol=0, msg=key)
    body = {k for k in src if k not in stems and not k.startswith(head)}
    assert body == {k for k in own if k not in stems and not k.startswith(head)}
    for key in body:
        torch.testing.assert_close(own[key], src[key], rtol=0, atol=0, msg=key)

    classifier = model.get_classifier()
    assert model.num_classes == num_classes
    if num_classes == 0:
        assert isinstance(classifier, nn.Identity)
    else:
        assert classifier.out_features == num_classes
    if num_classes == cfg["num_classes"]:  # the checkpoint's own head is kept
        for key in (k for k in src if k.startswith(head)):
            torch.testing.assert_close(own[key], src[key], rtol=0, atol=0, msg=key)

    input_size = get_model_input_config(model)["input_size"]
    assert input_size[0] == in_chans
    with torch.no_grad():
        out = model(torch.randn(2, *input_size))
    assert out.shape == (2, num_classes or model.num_features)
    assert torch.isfinite(out).all()
