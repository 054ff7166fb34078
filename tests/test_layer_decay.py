"""timm's layer-wise lr decay (``create_optimizer_v2(..., layer_decay=...)``) on the smallest model of every
registered family: every trainable parameter in exactly one group, and lr scales that rise with depth.

Depth is measured independently of ``group_matcher``: the order in which a forward pass first calls the module
that owns each parameter (the stem first, the head last)."""

import re

import pytest
import timm
import timm.optim
import torch

import ttt_zoo
from ttt_zoo.hub import example_inputs

FAMILIES = ttt_zoo.list_zoo_families(include_diffusion=True)


def test_every_family_is_checked():
    assert {"vit3", "hvit3", "dit", "dit3", "dit5", "t5", "visionttt"} <= set(FAMILIES)


def _call_order(model):
    """{parameter name: index of the first forward call of the module that owns it}."""
    order, hooks = {}, []

    def hook(name):
        def fn(module, args):
            order.setdefault(name, len(order))  # returns None: the inputs are left alone
        return fn
    for name, mod in model.named_modules():
        hooks.append(mod.register_forward_pre_hook(hook(name)))
    with torch.no_grad():
        inputs = example_inputs(model, 1)
        if len(inputs) == 1:  # image models: a small image is enough to see the call order
            inputs = example_inputs(model, 1, input_size=(3, 96, 96))
        model(*inputs)
    for h in hooks:
        h.remove()
    out = {}
    for n, _ in model.named_parameters():
        owner = n.rpartition(".")[0]
        while owner not in order:  # a module whose weights its parent uses directly: the parent's call
            owner = owner.rpartition(".")[0]
        out[n] = order[owner]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layer_decay_groups(family):
    model = timm.create_model(FAMILIES[family]).eval()
    decay = 0.75
    opt = timm.optim.create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=decay)
    scale = {}
    for g in opt.param_groups:
        for p in g["params"]:
            assert id(p) not in scale, "a parameter is in two groups"
            scale[id(p)] = g.get("lr_scale", 1.0)
    named = dict(model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert {n for n, p in named.items() if id(p) in scale} == trainable

    order = _call_order(model)
    called = sorted((order[n], n) for n in trainable)
    scales = [scale[id(named[n])] for _, n in called]
    bad = [(a, b) for (a, b), sa, sb in zip(zip(called, called[1:]), scales, scales[1:]) if sb < sa - 1e-12]
    assert not bad, f"lr scale falls with depth: {bad[:3]}"
    # one layer for the stem, one per block (the final norm shares the last block's), one for a classifier head
    n_blocks = sum(1 for n, _ in model.named_modules() if re.search(r"(^|\.)blocks\.\d+$", n))
    has_head = hasattr(model, "get_classifier") and any(True for _ in model.get_classifier().parameters())
    distinct = sorted(set(scales))
    assert len(distinct) == n_blocks + 1 + has_head
    assert max(distinct) == pytest.approx(1.0)
    assert min(distinct) == pytest.approx(decay ** (len(distinct) - 1))
    assert scales[0] == min(distinct)  # the first module called (the stem) decays most
