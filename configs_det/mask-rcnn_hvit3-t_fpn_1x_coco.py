# Mask R-CNN + FPN, H-ViT3-T backbone, 1x schedule (12 epochs), COCO. Spec §7 recipe.
_base_ = './_base_/mask-rcnn_ttt_fpn_coco.py'
model = dict(
    backbone=dict(arch='tiny', drop_path_rate=0.1,
                  init_cfg=dict(type='Pretrained', checkpoint='data/H-ViTTT-T.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))
