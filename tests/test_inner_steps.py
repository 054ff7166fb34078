"""Inference-time inner steps (Figure 1 of the linear-attention paper): the inner-loss curve against autograd."""
import pytest
import timm
import torch

import ttt_zoo  # noqa: F401
from ttt_zoo.analysis import record_inner_losses, vit3_inner_losses
from ttt_zoo.layers.mixer import set_inner_steps
from ttt_zoo.kernels.vit3_variant.naive import swiglu_inner_loss, swiglu_variant_steps


def _qkv(n=50, d=8, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(2, heads, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    w1, w2 = (0.1 * torch.randn(1, heads, d, d, generator=g, dtype=torch.float64) for _ in range(2))
    return k, v, w1, w2


def _normalize(g):
    return g / (g.norm(dim=-2, keepdim=True) + 1)


@pytest.mark.parametrize("last_only,linear,normalize,lr", [(False, False, True, 1.0), (True, False, True, 1.0),
                                                           (False, True, False, 1.0), (False, False, True, -1.0)])
def test_steps_follow_autograd(last_only, linear, normalize, lr):
    # every step is W <- W - lr * N(dL/dW) with dL/dW from autograd on the inner loss, in float64
    k, v, w1, w2 = _qkv()
    w2 = None if linear else w2
    steps = swiglu_variant_steps(k, v, w1, w2, 0.5, normalize, last_only, lr, steps=3)
    # per-sample inner weights: each sample's loss moves only its own copy
    a, b = w1.expand(2, -1, -1, -1).clone(), None if w2 is None else w2.expand(2, -1, -1, -1).clone()
    for s in range(3):
        a.requires_grad_(True)
        if b is not None:
            b.requires_grad_(True)
        loss = swiglu_inner_loss(k, v, a, b, 0.5).sum()
        grads = torch.autograd.grad(loss, [a] if b is None else [a, b])
        step = [(_normalize(g) if normalize else g) for g in grads]
        a = (a - lr * step[0]).detach()
        if b is not None:
            b = (b if last_only else b - lr * step[1]).detach()
        torch.testing.assert_close(steps[s + 1][0], a, rtol=1e-12, atol=1e-12)
        if b is not None:
            torch.testing.assert_close(steps[s + 1][1].expand_as(b), b, rtol=1e-12, atol=1e-12)


def test_last_layer_loss_falls_by_the_same_amount_each_step():
    # V1: the loss is linear in w1, so every step lowers it by exactly <G, N(G)> (ascent raises it by as much)
    k, v, w1, w2 = _qkv()
    for lr in (1.0, -1.0):
        losses = torch.stack([swiglu_inner_loss(k, v, a, b, 1 / 3).sum() for a, b in
                              swiglu_variant_steps(k, v, w1, w2, 1 / 3, True, True, lr, steps=4)])
        diffs = losses.diff()
        assert (diffs * lr < 0).all()
        torch.testing.assert_close(diffs, diffs[:1].expand(4), rtol=1e-10, atol=1e-14)


def test_model_curves_and_errors():
    model = timm.create_model("vit3_tiny", depth=2, img_size=32, patch_size=4).double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with record_inner_losses(model, steps=3) as losses:
        model(x)
    assert sorted(losses) == ["blocks.0.attn", "blocks.1.attn"] and losses["blocks.0.attn"][0].shape == (4,)
    # the curve's first point is the loss of the untrained inner weights on the mixer's own (k, v)
    mixer = model.blocks[0].attn
    tokens = model.patch_embed(x)
    curve = vit3_inner_losses(mixer, model.blocks[0].norm1(tokens.flatten(1, 2) if tokens.ndim == 4 else tokens),
                              (8, 8), 3)
    torch.testing.assert_close(curve, losses["blocks.0.attn"][0])
    set_inner_steps(model, 4)
    assert model.blocks[1].attn.inner_steps == 4
    with pytest.raises(ValueError, match="no ViT3 mixer"):
        with record_inner_losses(torch.nn.Linear(2, 2), 2):
            pass
    with pytest.raises(TypeError, match="ViT3TTT"):
        vit3_inner_losses(torch.nn.Linear(2, 2), x, (8, 8), 1)
