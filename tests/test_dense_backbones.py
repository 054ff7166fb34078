"""Dense (det/seg) backbones without OpenMMLab: released-checkpoint layout, classification init, freezing."""
import json

import pytest
import timm
import torch
import torch.nn.functional as F

from ttt_zoo.adapters import HViT3Dense, TimmDense
from ttt_zoo.checkpoint import CheckpointError, load_checkpoint_file
from fixtures import load_fixture

TINY = dict(embed_dim=(32, 32, 32, 32), depths=(1, 1, 1, 1))


def _mmengine_file(path, state, extra=None):
    """A checkpoint in the layout mmdet/mmseg release: meta + state_dict with ``backbone.``-prefixed keys."""
    sd = {"backbone." + k: v for k, v in state.items()}
    sd.update(extra or {})
    torch.save({"meta": {"mmengine_version": "0.10.7", "epoch": 12, "iter": 88000, "seed": 0,
                         "dataset_meta": {"classes": ("person", "car")}},
                "state_dict": sd}, path)


def test_released_layout_checkpoint_reproduces_fixture(tmp_path):
    t, state, meta, tol = load_fixture("det_backbone_tiny")
    kw = json.loads(meta["constructor_kwargs"])
    path = tmp_path / "mask_rcnn_vittt_tiny.pth"
    _mmengine_file(path, state, {"neck.lateral_convs.0.conv.weight": torch.randn(4, 32, 1, 1),
                                 "rpn_head.rpn_cls.bias": torch.randn(3)})
    model = HViT3Dense(embed_dim=kw["dim"], depths=kw["depths"], out_indices=kw["out_indices"], drop_path_rate=0.0,
                       init_cfg=dict(type="Pretrained", checkpoint=str(path))).double().eval()
    model.init_weights()
    assert model.is_init
    with torch.no_grad():
        outs = model(t["input.x"])
    assert [tuple(o.shape) for o in outs] == [(2, 32, 10, 14), (2, 32, 5, 7), (2, 32, 3, 4), (2, 32, 2, 2)]
    for i in range(4):
        torch.testing.assert_close(outs[i], t[f"output.{i}"], **tol)


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_checkpoint_with_objects_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": {"backbone.norm0.weight": torch.ones(32)}, "meta": _Evil()}, path)
    with pytest.raises(CheckpointError, match=r"Refusing to unpickle .*GLOBAL print"):
        load_checkpoint_file(str(path))
    with pytest.raises(CheckpointError, match="init_cfg"):
        HViT3Dense(init_cfg=dict(type="Pretrained", checkpoint=str(tmp_path / "missing.pth"))).init_weights()


def _cls_model(**kw):
    return timm.create_model("hvit3_tiny", num_heads=(1, 1, 1, 1), **TINY, **kw)


@pytest.mark.parametrize("prefer_ema", [False, True])
def test_classification_checkpoint_init(tmp_path, prefer_ema):
    torch.manual_seed(0)
    cls, ema = _cls_model().eval(), _cls_model().eval()
    path = tmp_path / "hvit3_tiny_cls.pth"
    torch.save({"model": cls.state_dict(), "state_dict_ema": ema.state_dict(), "epoch": 300}, path)
    dense = HViT3Dense(**TINY, drop_path_rate=0.0, prefer_ema=prefer_ema,
                       init_cfg=dict(type="Pretrained", checkpoint=str(path))).eval()
    dense.init_weights()
    src = ema if prefer_ema else cls  # the official det/seg init takes 'model'
    x = torch.randn(1, 3, 44, 60)
    with torch.no_grad():
        ref = src.forward_intermediates(x, intermediates_only=True)
        outs = dense(x)
    for r, o in zip(ref, outs):  # fresh norm{i}: a plain LayerNorm over channels
        expect = F.layer_norm(r.permute(0, 2, 3, 1), r.shape[1:2]).permute(0, 3, 1, 2)
        torch.testing.assert_close(o, expect, rtol=1e-5, atol=1e-5)


def test_wrong_size_checkpoint_names_the_problem(tmp_path):
    path = tmp_path / "tiny.pth"
    torch.save({"model": _cls_model().state_dict()}, path)
    dense = HViT3Dense(embed_dim=(64, 64, 64, 64), depths=(1, 1, 1, 1),
                       init_cfg=dict(type="Pretrained", checkpoint=str(path)))
    with pytest.raises(CheckpointError, match="shape mismatches"):
        dense.init_weights()


def test_frozen_stages_and_norm_eval():
    model = HViT3Dense(**TINY, frozen_stages=2, norm_eval=False)
    model.train()
    frozen = ("patch_embed.", "layers.0.", "layers.1.", "norm0.", "norm1.")
    for name, p in model.named_parameters():
        assert p.requires_grad == (not name.startswith(frozen)), name
    assert not model.patch_embed.training and not model.layers[1].training and model.layers[2].training
    stem_bn = model.patch_embed.conv[0].norm
    merge_bn = model.layers[2].downsample.conv[2].norm
    before = stem_bn.running_mean.clone(), merge_bn.running_mean.clone()
    sum(o.sum() for o in model(torch.randn(2, 3, 64, 64))).backward()
    assert torch.equal(stem_bn.running_mean, before[0])  # frozen BN stays in eval
    assert not torch.equal(merge_bn.running_mean, before[1])  # trainable BN updates
    assert model.layers[0].blocks[0].attn.qkv.weight.grad is None
    assert model.layers[2].blocks[0].attn.qkv.weight.grad is not None
    HViT3Dense(**TINY, norm_eval=True).train()
    assert not HViT3Dense(**TINY, norm_eval=True).train().layers[2].downsample.conv[2].norm.training


def test_grad_checkpointing_same_grads():
    torch.manual_seed(0)
    a = HViT3Dense(**TINY, drop_path_rate=0.0).double()
    b = HViT3Dense(**TINY, drop_path_rate=0.0, with_cp=True).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 40, 52, dtype=torch.float64)
    la, lb = [sum((o ** 2).mean() for o in m(x)) for m in (a, b)]
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, msg=n)


def test_timm_dense_plain_pyramid_any_size():
    model = TimmDense("vit3_tiny", model_kwargs=dict(depth=2), frozen_stages=1).eval()
    outs = model(torch.randn(1, 3, 64, 96))
    assert [tuple(o.shape) for o in outs] == [(1, 48, 16, 24), (1, 96, 8, 12), (1, 192, 4, 6), (1, 192, 2, 3)]
    assert model.out_channels == [48, 96, 192, 192]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("model.patch_embed.", "model.blocks.0.")) for n in frozen)
    assert all(p.requires_grad for p in model.model.blocks[1].parameters())
    beit = TimmDense("vit3_tiny", model_kwargs=dict(depth=4), out_indices=(0, 1, 2, 3)).eval()
    assert [o.shape[-1] for o in beit(torch.randn(1, 3, 32, 64))] == [16, 8, 4, 2]


def test_timm_dense_hierarchical_and_classification_init(tmp_path):
    torch.manual_seed(0)
    cls = _cls_model().eval()
    path = tmp_path / "cls.pth"
    torch.save({"model": cls.state_dict()}, path)
    model = TimmDense("hvit3_tiny", model_kwargs=dict(num_heads=(1, 1, 1, 1), **TINY),
                      init_cfg=dict(type="Pretrained", checkpoint=str(path))).eval()
    model.init_weights()
    x = torch.randn(1, 3, 36, 68)
    with torch.no_grad():
        ref = cls.forward_intermediates(x, intermediates_only=True)
        outs = model(x)
    assert [o.shape[1] for o in outs] == model.out_channels == [32, 32, 32, 32]
    for r, o in zip(ref, outs):
        expect = F.layer_norm(r.permute(0, 2, 3, 1), r.shape[1:2]).permute(0, 3, 1, 2)
        torch.testing.assert_close(o, expect, rtol=1e-5, atol=1e-5)
    # its own det/seg checkpoint (backbone.* keys) round-trips
    path2 = tmp_path / "det.pth"
    _mmengine_file(path2, model.state_dict())
    again = TimmDense("hvit3_tiny", model_kwargs=dict(num_heads=(1, 1, 1, 1), **TINY),
                      init_cfg=dict(type="Pretrained", checkpoint=str(path2))).eval()
    again.init_weights()
    with torch.no_grad():
        for a, b in zip(again(x), outs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="arch must be one of"):
        HViT3Dense(arch="huge")
    with pytest.raises(ValueError, match="frozen_stages"):
        HViT3Dense(**TINY, frozen_stages=7)
    with pytest.raises(ValueError, match="init_cfg must be None or dict"):
        HViT3Dense(**TINY, init_cfg=dict(type="Kaiming")).init_weights()
    with pytest.raises(ValueError, match="not a ttt_zoo model"):
        TimmDense("resnet18")
    with pytest.raises(ValueError, match="1 \\(ViTDet\\) or 4"):
        TimmDense("vit3_tiny", model_kwargs=dict(depth=2), out_indices=(0, 1))
    with pytest.raises(ValueError, match="3 input channels"):
        HViT3Dense(**TINY)(torch.randn(1, 1, 32, 32))
