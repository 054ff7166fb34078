"""An empty batch gives an empty output for every registered family (issue 12: vit3, hvit3 and dit3 crashed with
``non-positive groups is not supported`` in the ViT3 depthwise-conv inner step)."""
import pytest
import timm
import torch

from ttt_zoo import is_diffusion_model, list_zoo_families

# the smallest registered model of every family, from the registry (diffusion ones run on a 32x32 latent)
FAMILIES = list_zoo_families(include_diffusion=True)
IMAGE_MODELS = [n for n in FAMILIES.values() if not is_diffusion_model(n)]
DIFFUSION_MODELS = [n for n in FAMILIES.values() if is_diffusion_model(n)]


def test_every_family_is_listed():
    assert set(FAMILIES) >= {"vit3", "hvit3", "t5", "t5_plus", "visionttt", "visionttt_h", "dit", "dit3", "dit5"}


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
