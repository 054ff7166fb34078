"""OpenMMLab integration: registries, safe checkpoint loading, and real smoke training of the configs.

Each smoke test takes a real config from configs_det/ or configs_seg/, shrinks the backbone/shapes, writes its own
synthetic dataset (COCO with polygon masks / ADE20K layout), trains 2 iterations with mmdet's or mmseg's own
tools/train.py, validates (CocoMetric / IoUMetric), saves a checkpoint, then reloads it with our tools/mm_test.py.
Skipped when the OpenMMLab stack is not installed (`make openmmlab`).
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch

pytest.importorskip("mmcv.ops", reason="OpenMMLab stack not installed (make openmmlab)")
pytest.importorskip("mmdet", reason="mmdet not installed (make openmmlab)")
pytest.importorskip("mmseg", reason="mmseg not installed (make openmmlab)")
cv2 = pytest.importorskip("cv2")

from fixtures import load_fixture  # noqa: E402

pytestmark = pytest.mark.mm
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(embed_dim=[32, 32, 32, 32], depths=[1, 1, 1, 1])


def _without_warnings(text):
    """stderr without Python's warnings (each a 'file:line: XWarning: ...' line and its indented source line):
    the libraries' deprecation warnings otherwise fill the tail that a failure report shows."""
    keep, skip = [], False
    for line in text.splitlines():
        if re.search(r":\d+: \w*Warning: ", line):
            skip = True
            continue
        if skip and (line.startswith(" ") or line.startswith(("grad.sizes", "bucket_view"))):
            continue
        skip = False
        keep.append(line)
    return "\n".join(keep)


def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{_without_warnings(proc.stderr)[-6000:]}")
    return proc.stdout + proc.stderr


def _tiny_cls_checkpoint(path):
    """A tiny H-ViT3 classification checkpoint (official layout {'model': ...}) for init_cfg."""
    model = timm.create_model("hvit3_tiny", num_heads=(1, 1, 1, 1), **TINY)
    torch.save({"model": model.state_dict()}, path)
    return model


def test_registered_in_both_registries():
    import ttt_zoo.adapters.mmdet  # noqa: F401
    from mmdet.registry import MODELS as DET
    from mmseg.registry import MODELS as SEG
    from ttt_zoo.adapters import HViT3Dense, TimmDense
    for reg in (DET, SEG):
        assert reg.get("TTTHViT3") is HViT3Dense and reg.get("TTTTimm") is TimmDense
    model = DET.build(dict(type="TTTHViT3", **TINY, frozen_stages=1))
    assert isinstance(model, HViT3Dense) and not model.patch_embed.conv[0].conv.weight.requires_grad


def test_mmengine_layout_loads_through_registry_and_reproduces_fixture(tmp_path):
    import ttt_zoo.adapters.mmseg  # noqa: F401
    from mmseg.registry import MODELS
    t, state, meta, tol = load_fixture("det_backbone_tiny")
    path = tmp_path / "upernet_vittt_tiny.pth"
    torch.save({"meta": {"mmseg_version": "1.2.2", "iter": 160000},
                "state_dict": {"backbone." + k: v for k, v in state.items()}}, path)
    kw = json.loads(meta["constructor_kwargs"])
    model = MODELS.build(dict(type="TTTHViT3", embed_dim=kw["dim"], depths=kw["depths"], drop_path_rate=0.0,
                              init_cfg=dict(type="Pretrained", checkpoint=str(path)))).double().eval()
    model.init_weights()
    with torch.no_grad():
        outs = model(t["input.x"])
    for i in range(4):
        torch.testing.assert_close(outs[i], t[f"output.{i}"], **tol)


# the safe mmengine checkpoint loader (load_from / resume) needs mmengine only: tests/test_checkpoint.py


# ---------------------------------------------------------------- synthetic datasets
def _coco(root, split, n, rng):
    """COCO instances with polygon masks: rectangles and triangles on noise ('person' and 'car' of the 80 classes)."""
    from mmdet.datasets import CocoDataset
    os.makedirs(os.path.join(root, f"{split}2017"), exist_ok=True)
    images, anns = [], []
    for i in range(n):
        h, w = 96, 128
        img = rng.integers(0, 60, (h, w, 3), dtype=np.uint8)
        for j in range(2):
            x0, y0 = int(rng.integers(4, w // 2)), int(rng.integers(4, h // 2))
            bw, bh = int(rng.integers(24, w // 2 - 4)), int(rng.integers(24, h // 2 - 4))
            if j == 0:
                poly = [x0, y0, x0 + bw, y0, x0 + bw, y0 + bh, x0, y0 + bh]
            else:
                poly = [x0, y0 + bh, x0 + bw // 2, y0, x0 + bw, y0 + bh]
            pts = np.array(poly, np.int32).reshape(-1, 2)
            cv2.fillPoly(img, [pts], (200, 60 + 120 * j, 40))
            area = float(cv2.contourArea(pts.astype(np.float32)))
            anns.append(dict(id=len(anns) + 1, image_id=i + 1, category_id=(1, 3)[j], segmentation=[poly],
                             area=area, bbox=[x0, y0, bw, bh], iscrowd=0))
        name = f"{i:06d}.jpg"
        cv2.imwrite(os.path.join(root, f"{split}2017", name), img)
        images.append(dict(id=i + 1, file_name=name, height=h, width=w))
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    with open(os.path.join(root, "annotations", f"instances_{split}2017.json"), "w") as f:
        json.dump(dict(images=images, annotations=anns,
                       categories=[dict(id=i + 1, name=c) for i, c in enumerate(CocoDataset.METAINFO["classes"])]), f)


def _ade(root, split, n, rng):
    """ADE20K layout: images/<split>/*.jpg, annotations/<split>/*.png (0 = ignore, 1..150 = classes)."""
    for sub in ("images", "annotations"):
        os.makedirs(os.path.join(root, sub, split), exist_ok=True)
    for i in range(n):
        seg = np.zeros((64, 80), np.uint8)
        seg[:, :40] = 1 + rng.integers(0, 150)
        seg[20:50, 30:70] = 1 + rng.integers(0, 150)
        img = (seg[..., None] * np.array([1, 3, 7]) % 255).astype(np.uint8) + rng.integers(0, 20, (64, 80, 3)).astype(np.uint8)
        cv2.imwrite(os.path.join(root, "images", split, f"ADE_{split}_{i:08d}.jpg"), img)
        cv2.imwrite(os.path.join(root, "annotations", split, f"ADE_{split}_{i:08d}.png"), seg)


def _train_and_test(tmp_path, config, pkg):
    work = tmp_path / "work"
    train = os.path.join(os.path.dirname(__import__(pkg).__file__), ".mim", "tools", "train.py")
    log = _run([train, str(config), "--work-dir", str(work)], cwd=tmp_path)  # the package's own train.py
    ckpts = sorted(p for p in os.listdir(work) if p.endswith(".pth"))
    assert ckpts, f"no checkpoint saved in {work}: {os.listdir(work)}"
    out = _run([os.path.join(ROOT, "tools", "mm_test.py"), str(config), str(work / ckpts[-1]),
                "--work-dir", str(tmp_path / "test")], cwd=tmp_path)  # our wrapper, reloading the checkpoint
    return log, out, work / ckpts[-1]


def _mask_rcnn_config(tmp_path):
    """A shrunk configs_det Mask R-CNN on a synthetic 2+2-image COCO; returns (config path, init checkpoint)."""
    rng = np.random.default_rng(0)
    data = tmp_path / "coco"
    _coco(str(data), "train", 2, rng)
    _coco(str(data), "val", 2, rng)
    init = tmp_path / "hvit3_tiny_cls.pth"
    _tiny_cls_checkpoint(init)
    small = [(128, 96), (128, 80)]
    cfg = tmp_path / "mask_rcnn_smoke.py"
    cfg.write_text(f"""
_base_ = {os.path.join(ROOT, 'configs_det', 'mask-rcnn_hvit3-t_fpn_1x_coco.py')!r}
data_root = {str(data) + '/'!r}
# no stochastic depth: a block dropped for the whole (2-image) batch in both steps gets no gradient, and AdamW's
# decay at the warm-up's lr is below a float32 ulp, so "trained stages moved" would hold only by chance
model = dict(backbone=dict(embed_dim={TINY['embed_dim']}, depths={TINY['depths']}, frozen_stages=0, drop_path_rate=0.0,
                           use_checkpoint=False, init_cfg=dict(type='Pretrained', checkpoint={str(init)!r})),
             neck=dict(in_channels={TINY['embed_dim']}, out_channels=32),
             rpn_head=dict(in_channels=32, feat_channels=32),
             roi_head=dict(bbox_roi_extractor=dict(out_channels=32), bbox_head=dict(in_channels=32, fc_out_channels=64),
                           mask_roi_extractor=dict(out_channels=32), mask_head=dict(in_channels=32, conv_out_channels=32)),
             # an untrained head scores ~1/81 per class: keep every box so CocoMetric has results to score
             test_cfg=dict(rcnn=dict(score_thr=0.0)))
train_pipeline = [
    dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5), dict(type='RandomChoiceResize', scales={small}, keep_ratio=True),
    dict(type='PackDetInputs')]
test_pipeline = [
    dict(type='LoadImageFromFile'), dict(type='Resize', scale=(128, 96), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator
train_cfg = dict(max_epochs=2, val_interval=2)
optim_wrapper = dict(type='OptimWrapper')  # AmpOptimWrapper needs a GPU
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=2))
randomness = dict(seed=0)
""")
    return cfg, init


def test_mask_rcnn_hvit3_smoke_train(tmp_path):
    cfg, init = _mask_rcnn_config(tmp_path)
    log, out, ckpt = _train_and_test(tmp_path, cfg, "mmdet")
    assert re.search(r"Epoch\(train\) +\[2\]\[1/1\].*loss_mask", log), log[-3000:]
    assert "coco/bbox_mAP" in log and "coco/segm_mAP" in log, log[-3000:]
    assert "coco/bbox_mAP" in out and "coco/segm_mAP" in out, out[-3000:]
    sd = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    init_sd = torch.load(init, weights_only=True)["model"]
    # frozen stem kept its pretrained weights, trained stages moved away from them
    k = "patch_embed.conv.0.conv.weight"
    assert torch.equal(sd["backbone." + k], init_sd[k])
    k = "layers.3.blocks.0.attn.qkv.weight"
    assert not torch.equal(sd["backbone." + k], init_sd[k])


def _upernet_config(tmp_path):
    """A shrunk configs_seg UPerNet on a synthetic 2+2-image ADE20K; returns the config path."""
    rng = np.random.default_rng(0)
    data = tmp_path / "ade"
    _ade(str(data), "training", 2, rng)
    _ade(str(data), "validation", 2, rng)
    cfg = tmp_path / "upernet_smoke.py"
    cfg.write_text(f"""
_base_ = {os.path.join(ROOT, 'configs_seg', 'upernet_hvit3-t_160k_ade20k-512x512.py')!r}
data_root = {str(data)!r}
crop_size = (64, 64)
model = dict(data_preprocessor=dict(size=crop_size),
             backbone=dict(embed_dim={TINY['embed_dim']}, depths={TINY['depths']}, init_cfg=None),
             decode_head=dict(in_channels={TINY['embed_dim']}, channels=32),
             auxiliary_head=dict(in_channels=32, channels=16))
train_pipeline = [
    dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(128, 64), ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75), dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'), dict(type='PackSegInputs')]
test_pipeline = [
    dict(type='LoadImageFromFile'), dict(type='Resize', scale=(128, 64), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True), dict(type='PackSegInputs')]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
train_cfg = dict(max_iters=2, val_interval=2)
optim_wrapper = dict(type='OptimWrapper')  # AmpOptimWrapper needs a GPU
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=2))
""")
    return cfg


def test_upernet_hvit3_smoke_train(tmp_path):
    cfg = _upernet_config(tmp_path)
    log, out, ckpt = _train_and_test(tmp_path, cfg, "mmseg")
    assert re.search(r"Iter\(train\) +\[2/2\].*loss", log), log[-3000:]
    assert "mIoU" in log and "mIoU" in out, out[-3000:]


# ---------------------------------------------------------------- 2-process launch (torchrun, CPU: gloo)
def _torchrun_train(tmp_path, config):
    """torchrun --nproc_per_node 2 tools/mm_train.py CONFIG --launcher pytorch, then reload its checkpoint."""
    work = tmp_path / "work2"
    log = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                os.path.join(ROOT, "tools", "mm_train.py"), str(config), "--launcher", "pytorch",
                "--work-dir", str(work)], cwd=tmp_path)
    # mmengine's environment report: 2 processes (it calls the world size "GPU number"), gloo, our CPU DDP wrapper
    for line in ("Distributed launcher: pytorch", "Distributed training: True", "GPU number: 2", "'backend': 'gloo'",
                 "type='CPUDistributedDataParallel'"):
        assert line in log, f"{line!r} not in the log:\n{log[-3000:]}"
    ckpts = sorted(p for p in os.listdir(work) if p.endswith(".pth"))
    assert ckpts, f"no checkpoint saved in {work}: {os.listdir(work)}"
    out = _run([os.path.join(ROOT, "tools", "mm_test.py"), str(config), str(work / ckpts[-1]),
                "--work-dir", str(tmp_path / "test2")], cwd=tmp_path)
    return log, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path of --launcher pytorch")
def test_mask_rcnn_two_process_launch(tmp_path):
    cfg, _ = _mask_rcnn_config(tmp_path)
    log, out = _torchrun_train(tmp_path, cfg)
    # 2 images over 2 ranks: one iteration per epoch on each rank
    assert re.search(r"Epoch\(train\) +\[2\]\[1/1\].*loss_mask", log), log[-3000:]
    assert "coco/bbox_mAP" in out, out[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) path of --launcher pytorch")
def test_upernet_two_process_launch(tmp_path):
    cfg = _upernet_config(tmp_path)
    log, out = _torchrun_train(tmp_path, cfg)
    assert re.search(r"Iter\(train\) +\[2/2\].*loss", log), log[-3000:]
    assert "mIoU" in out, out[-3000:]


# ---------------------------------------------------------------- every shipped config
SPEC_DET = {  # spec §7: drop_path per size and schedule, channels per size
    "t": dict(dp={"1x": 0.1, "3x": 0.3}), "s": dict(dp={"1x": 0.1, "3x": 0.4}), "b": dict(dp={"1x": 0.1, "3x": 0.6})}
SPEC_SEG = {"t": (0.2, "AmpOptimWrapper"), "s": (0.4, "OptimWrapper"), "b": (0.5, "OptimWrapper")}


def _configs(folder):
    d = os.path.join(ROOT, folder)
    return sorted(f for f in os.listdir(d) if f.endswith(".py"))


def _shallow_backbone(registry, cfg):
    """The config's backbone with one block per stage (channels, which the heads depend on, are unchanged)."""
    from ttt_zoo import list_zoo_models
    cfg = dict(cfg, init_cfg=None)
    if cfg["type"] == "TTTHViT3":
        cfg["depths"] = [1, 1, 1, 1]
        return registry.build(cfg)
    if cfg["model_name"] not in list_zoo_models():
        pytest.skip(f"{cfg['model_name']} is not in this build of ttt_zoo")
    hierarchical = cfg["model_name"].startswith("hvit3") or "_h_" in cfg["model_name"]
    cfg["model_kwargs"] = dict(cfg.get("model_kwargs") or {}, **(dict(depths=[1, 1, 1, 1]) if hierarchical else dict(depth=1)))
    return registry.build(cfg)


@pytest.mark.parametrize("name", _configs("configs_det"))
def test_det_config_wiring_and_recipe(name):
    import ttt_zoo.adapters.mmdet  # noqa: F401
    from mmengine.config import Config
    from mmdet.registry import MODELS
    cfg = Config.fromfile(os.path.join(ROOT, "configs_det", name))
    bb = _shallow_backbone(MODELS, cfg.model.backbone)
    assert list(cfg.model.neck.in_channels) == bb.out_channels
    assert cfg.model.type == "MaskRCNN" and cfg.model.neck.type == "FPN"
    opt = cfg.optim_wrapper
    assert opt.type == "AmpOptimWrapper" and opt.optimizer.type == "AdamW"
    assert (opt.optimizer.lr, opt.optimizer.weight_decay) == (2e-4, 0.05)
    assert opt.paramwise_cfg.custom_keys["norm"] == dict(decay_mult=0.)
    sched = "3x" if "_3x_" in name else "1x"
    epochs, milestones = (36, [27, 33]) if sched == "3x" else (12, [8, 11])
    assert cfg.train_cfg.max_epochs == epochs and cfg.param_scheduler[1].milestones == milestones
    assert cfg.param_scheduler[0].end == 1000 and cfg.param_scheduler[0].start_factor == 0.001
    assert cfg.train_dataloader.dataset.pipeline[3].type == "RandomChoice"  # multi-scale + crop, both schedules
    if "hvit3" in name:
        size = name.split("hvit3-")[1][0]
        assert cfg.model.backbone.drop_path_rate == SPEC_DET[size]["dp"][sched]
        assert cfg.model.backbone.arch == dict(t="tiny", s="small", b="base")[size]


@pytest.mark.parametrize("name", _configs("configs_seg"))
def test_seg_config_wiring_and_recipe(name):
    import ttt_zoo.adapters.mmseg  # noqa: F401
    from mmengine.config import Config
    from mmseg.registry import MODELS
    cfg = Config.fromfile(os.path.join(ROOT, "configs_seg", name))
    bb = _shallow_backbone(MODELS, cfg.model.backbone)
    assert list(cfg.model.decode_head.in_channels) == bb.out_channels
    assert cfg.model.auxiliary_head.in_channels == bb.out_channels[2]
    assert cfg.model.decode_head.num_classes == cfg.model.auxiliary_head.num_classes == 150
    assert cfg.crop_size == (512, 512) and cfg.train_cfg.max_iters == 160000
    opt = cfg.optim_wrapper
    assert (opt.optimizer.lr, opt.optimizer.weight_decay) == (6e-5, 0.01)
    assert opt.paramwise_cfg.custom_keys["norm"] == dict(decay_mult=0.)
    warm, poly = cfg.param_scheduler
    assert (warm.start_factor, warm.end, poly.type, poly.power, poly.eta_min, poly.end) == (1e-6, 1500, "PolyLR", 1.0, 0.0, 160000)
    assert cfg.train_dataloader.batch_size == 2
    if "hvit3" in name:
        dp, wrapper = SPEC_SEG[name.split("hvit3-")[1][0]]
        assert cfg.model.backbone.drop_path_rate == dp and opt.type == wrapper


def test_plain_vit3_configs_build_and_run():
    """The ViT3 + simple-pyramid configs: real models (2 blocks), forward through FPN / UPerNet."""
    import ttt_zoo.adapters.mmdet  # noqa: F401
    import ttt_zoo.adapters.mmseg  # noqa: F401
    from mmengine.config import Config
    from mmdet.registry import MODELS as DET
    from mmseg.registry import MODELS as SEG
    small = dict(model_kwargs=dict(depth=2), init_cfg=None)
    cfg = Config.fromfile(os.path.join(ROOT, "configs_det", "mask-rcnn_vit3-t_fpn_1x_coco.py"))
    cfg.model.backbone.update(small)
    det = DET.build(cfg.model).eval()
    with torch.no_grad():
        feats = det.extract_feat(torch.randn(1, 3, 64, 96))
    assert [tuple(f.shape) for f in feats] == [(1, 256, 16, 24), (1, 256, 8, 12), (1, 256, 4, 6), (1, 256, 2, 3),
                                               (1, 256, 1, 2)]
    cfg = Config.fromfile(os.path.join(ROOT, "configs_seg", "upernet_vit3-t_160k_ade20k-512x512.py"))
    cfg.model.backbone.update(small)
    cfg.model.decode_head.update(channels=32)
    seg = SEG.build(cfg.model).eval()
    with torch.no_grad():
        logits = seg(torch.randn(2, 3, 64, 96), mode="tensor")
    assert tuple(logits.shape) == (2, 150, 16, 24)
