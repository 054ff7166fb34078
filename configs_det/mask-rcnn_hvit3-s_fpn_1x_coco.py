# Mask R-CNN + FPN, H-ViT3-S backbone, 1x schedule (12 epochs), COCO. Spec §7 recipe.
_base_ = './_base_/mask-rcnn_ttt_fpn_coco.py'
model = dict(
    backbone=dict(arch='small', drop_path_rate=0.1,
                  init_cfg=dict(type='Pretrained', checkpoint='data/H-ViTTT-S.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))
