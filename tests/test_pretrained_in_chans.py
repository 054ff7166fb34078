"""pretrained=True with another in_chans and any num_classes, as timm's own models load (issue 30, item 7).

timm's ``load_pretrained`` adapts the cfg's ``first_conv`` with ``adapt_input_conv`` and drops the ``classifier``
when ``num_classes`` differs; our filter's checks must let it.  The families come from the timm registry: one
model per code path of the registry (tests/test_registry_contract.py, which calls these helpers), so a new
family or variant is tested too."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never download

import timm  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from timm.models import adapt_input_conv, get_model_input_config  # noqa: E402
from torch import nn  # noqa: E402


def _first_convs(cfg):
    convs = cfg.get("first_conv")
    return (convs,) if isinstance(convs, str) else tuple(convs or ())


def write_source(name, kwargs, folder):
    """Seeded weights of ``name`` built with ``kwargs`` (every tensor unlike a fresh init; variances stay positive),
    written to ``folder``/model.safetensors: (path, state dict)."""
    torch.manual_seed(0)
    src = timm.create_model(name, **kwargs)
    with torch.no_grad():
        for v in src.state_dict().values():
            if v.is_floating_point():
                v.add_(torch.rand_like(v), alpha=0.01)
    sd = {k: v.clone().contiguous() for k, v in src.state_dict().items()}
    path = os.path.join(str(folder), "model.safetensors")
    save_file(sd, path)
    return path, sd


def check_pretrained_load(name, kwargs, path, src, in_chans, num_classes):
    """``pretrained=True`` from ``path`` with ``in_chans`` and ``num_classes``: the stem adapted as timm's
    ``adapt_input_conv`` does, the body bit for bit, the head kept or replaced, a finite forward."""
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
