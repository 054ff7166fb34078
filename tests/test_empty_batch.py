"""An empty batch gives an empty output for every registered family (issue 12: vit3, hvit3 and dit3 crashed with
``non-positive groups is not supported`` in the ViT3 depthwise-conv inner step)."""
import pytest
import timm
import torch

from ttt_zoo.models import DIFFUSION_MODULES, MODEL_MODULES

# the smallest registered model of every family, from the registry: *_tiny (image), *_s_2 (diffusion, 32x32 latent)
IMAGE_MODELS = [n for m in MODEL_MODULES if m not in DIFFUSION_MODULES
                for n in timm.list_models(module=m) if n.endswith("_tiny")]
DIFFUSION_MODELS = [n for m in DIFFUSION_MODULES for n in timm.list_models(module=m) if n.endswith("_s_2")]


def test_every_family_is_listed():
    assert {n.rsplit("_", 1)[0] for n in IMAGE_MODELS} >= {"vit3", "hvit3", "t5", "t5_plus", "visionttt",
                                                          "visionttt_h"}
    assert len(DIFFUSION_MODELS) == len(DIFFUSION_MODULES)


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_image_model_empty_batch(name):
    model = timm.create_model(name, num_classes=10).eval()
    x = torch.zeros(0, 3, 224, 224)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (0, 10)
    model.train()
    out = model(x.requires_grad_())
    out.sum().backward()  # the backward of an empty batch runs too
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("name", DIFFUSION_MODELS)
def test_diffusion_model_empty_batch(name):
    model = timm.create_model(name).eval()
    x, t, y = torch.zeros(0, 4, 32, 32), torch.zeros(0), torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        out = model(x, t, y)
    assert out.shape[0] == 0 and out.shape[2:] == (32, 32)
