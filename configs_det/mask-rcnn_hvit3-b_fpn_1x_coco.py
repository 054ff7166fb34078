# Mask R-CNN + FPN, H-ViT3-B backbone, 1x schedule (12 epochs), COCO. Spec §7 recipe.
_base_ = './_base_/mask-rcnn_ttt_fpn_coco.py'
model = dict(
    backbone=dict(arch='base', drop_path_rate=0.1,
                  init_cfg=dict(type='Pretrained', checkpoint='data/H-ViTTT-B.pth')),
    neck=dict(in_channels=[96, 192, 448, 640]))
