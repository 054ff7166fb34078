"""linearize(): every inherited tensor is copied exactly and only the TTT parameters are new."""
import sys

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import ttt_zoo
from ttt_zoo.linearize import param_groups
from ttt_zoo.models import T5

_NEW = ("w1", "w2", "w3", "q_conv2d.weight", "q_conv2d.bias", "k_conv2d.weight", "k_conv2d.bias")


def _vit(**kw):
    args = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=7)
    model = VisionTransformer(**dict(args, **kw))
    with torch.no_grad():  # make every tensor distinctive (LayerNorm 1/0 and zero biases would hide mistakes)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _expected_new(depth):
    return {f"blocks.{i}.attn.{n}" for i in range(depth) for n in _NEW}


def _check_inherited(src, dst, new, pos_prefix):
    sd_src, sd_dst = src.state_dict(), dst.state_dict()
    inherited = [k for k in sd_dst if k not in new]
    assert set(inherited) | set(new) == set(sd_dst) and not set(inherited) & set(new)
    for k in inherited:
        expected = sd_src[k][:, pos_prefix:] if k == "pos_embed" else sd_src[k]
        assert torch.equal(sd_dst[k], expected), k
    # everything in the source except tokens / distillation head has a copy
    assert {k for k in sd_src if k not in ("cls_token", "dist_token") and not k.startswith("head_dist.")} == set(inherited)


@pytest.mark.parametrize("kind", ["deit_cls_token", "no_cls_token_avg", "no_embed_class"])
def test_inherits_every_tensor(kind):
    kw = {"deit_cls_token": {}, "no_cls_token_avg": dict(class_token=False, global_pool="avg", fc_norm=False),
          "no_embed_class": dict(no_embed_class=True)}[kind]
    src = _vit(**kw)
    model, new = ttt_zoo.linearize(src)
    assert isinstance(model, T5) and not model.training
    assert list(new) and set(new) == _expected_new(2) and len(new) == len(set(new))
    prefix = 1 if kind == "deit_cls_token" else 0
    _check_inherited(src, model, set(new), prefix)
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7) and torch.isfinite(out).all()


def test_deit_distilled():
    src = timm.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=4, embed_dim=32, depth=1,
                            num_heads=2, num_classes=5).eval()
    model, new = ttt_zoo.linearize(src)
    assert set(new) == _expected_new(1)
    _check_inherited(src, model, set(new), 2)


def test_float64_and_t5_plus():
    src = _vit().double()
    model, new = ttt_zoo.linearize(src, na_kernel=3)
    assert model.blocks[0].attn.na_kernel == 3 and set(new) == _expected_new(2)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    _check_inherited(src, model, set(new), 1)
    assert torch.isfinite(model(torch.randn(1, 3, 32, 32, dtype=torch.float64))).all()


def test_img_size_resamples_pos_embed():
    src = _vit()
    model, _ = ttt_zoo.linearize(src, img_size=(48, 32))
    assert model.grid_size == (12, 8)
    expected = resample_abs_pos_embed(src.pos_embed[:, 1:].detach(), new_size=[12, 8], old_size=[8, 8],
                                      num_prefix_tokens=0)
    torch.testing.assert_close(model.pos_embed.detach(), expected)
    assert torch.equal(model.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight)


@pytest.mark.parametrize("kw,msg", [(dict(init_values=0.1), "layer scale"), (dict(qk_norm=True), "q/k"),
                                    (dict(global_pool="avg"), "fc_norm"), (dict(reg_tokens=2), "register"),
                                    (dict(pre_norm=True), "pre-norm"), (dict(final_norm=False), "LayerNorm"),
                                    (dict(act_layer="gelu_tanh"), "exact GELU")])
def test_unsupported_vits_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ttt_zoo.linearize(_vit(**kw))


def test_other_models_raise():
    with pytest.raises(TypeError, match="VisionTransformer"):
        ttt_zoo.linearize(nn.Linear(2, 2))


class _FakeDiT(nn.Module):
    def __init__(self):
        super().__init__()
        self.x_embedder = nn.Linear(2, 2)
        self.t_embedder = nn.Linear(2, 2)


def test_dit_dispatch(monkeypatch):
    calls = []
    fake = lambda model, **kw: calls.append((model, kw)) or ("converted", ["x"])  # noqa: E731
    monkeypatch.setattr(sys.modules["ttt_zoo.linearize"], "linearize_dit", fake)
    dit = _FakeDiT()
    assert ttt_zoo.linearize(dit, foo=1) == ("converted", ["x"])
    assert calls == [(dit, {"foo": 1})]


def test_param_groups_multiplier_and_decay():
    model, new = ttt_zoo.linearize(_vit())
    groups = param_groups(model, new, lr=1e-3, weight_decay=0.05)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"decay", "no_decay", "new_decay", "new_no_decay"}
    assert by_name["new_decay"]["lr_scale"] == 20.0 and by_name["new_no_decay"]["lr_scale"] == 20.0
    assert by_name["decay"]["lr_scale"] == 1.0 and by_name["no_decay"]["lr_scale"] == 1.0
    assert all(g["lr"] == 1e-3 for g in groups)  # base lr; the scale is relative
    ids = {id(p): g["name"] for g in groups for p in g["params"]}
    assert len(ids) == sum(len(g["params"]) for g in groups)  # no parameter twice
    named = dict(model.named_parameters())
    assert set(ids) == {id(p) for p in named.values()}
    for n, p in named.items():
        group = ids[id(p)]
        assert group.startswith("new") == (n in new), n
        assert group.endswith("no_decay") == (p.ndim <= 1 or n == "pos_embed"), n
    assert by_name["no_decay"]["weight_decay"] == 0.0 and by_name["new_decay"]["weight_decay"] == 0.05
    torch.optim.AdamW(groups).step()  # valid optimizer groups
    dit = _FakeDiT()
    dit_groups = {g["name"]: g for g in param_groups(dit, ["x_embedder.weight"], lr=1.0)}
    assert dit_groups["new_decay"]["lr_scale"] == 2.0 and dit_groups["decay"]["lr_scale"] == 1.0
    with pytest.raises(ValueError, match="not in the model"):
        param_groups(model, ["blocks.9.attn.w1"], lr=1.0)


def test_param_groups_layer_decay_times_multiplier():
    """With layer decay, each new parameter's scale is its layer's timm scale times the multiplier."""
    from timm.optim import param_groups_layer_decay
    model, new = ttt_zoo.linearize(_vit(depth=3))
    ref = param_groups_layer_decay(model, weight_decay=0.05, no_weight_decay_list=model.no_weight_decay(),
                                   layer_decay=0.5)
    ref_scale = {id(p): g["lr_scale"] for g in ref for p in g["params"]}
    assert len(set(ref_scale.values())) > 2  # the layers really differ
    groups = param_groups(model, new, multiplier=10.0, weight_decay=0.05, layer_decay=0.5)
    named = dict(model.named_parameters())
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    assert set(scale) == {id(p) for p in named.values()}
    for n, p in named.items():
        assert scale[id(p)] == pytest.approx(ref_scale[id(p)] * (10.0 if n in new else 1.0)), n


@pytest.mark.parametrize("sched", ["cosine", "step"])
def test_param_groups_ratio_survives_timm_scheduler(sched):
    """timm's schedulers multiply lr_scale in, so warmup start, the middle and the min_lr floor keep 20x."""
    from timm.scheduler import create_scheduler_v2
    model, new = ttt_zoo.linearize(_vit())
    opt = torch.optim.SGD(param_groups(model, new, lr=1e-3, weight_decay=0.05), lr=1e-3)
    sch, epochs = create_scheduler_v2(opt, sched=sched, num_epochs=10, decay_epochs=3, warmup_epochs=2,
                                      warmup_lr=1e-6, min_lr=1e-5, updates_per_epoch=5, step_on_epochs=False)
    seen = []
    for t in (0, 5, 25, 49, 10 ** 4):  # warmup start, warmup, middle, end, far past the end (min_lr floor)
        sch.step_update(t)
        lrs = {g["name"]: g["lr"] for g in opt.param_groups}
        assert lrs["new_decay"] == pytest.approx(20 * lrs["decay"], rel=1e-12)
        assert lrs["new_no_decay"] == pytest.approx(20 * lrs["no_decay"], rel=1e-12)
        seen.append(lrs["decay"])
    assert seen[0] == pytest.approx(1e-6)  # warmup_lr floor, scaled for the new group
    if sched == "cosine":
        assert seen[-1] == pytest.approx(1e-5)  # min_lr floor, scaled for the new group
    assert len(set(seen)) >= 3
