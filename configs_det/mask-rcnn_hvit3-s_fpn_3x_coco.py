# Mask R-CNN + FPN, H-ViT3-S backbone, 3x schedule (36 epochs), COCO. Spec §7 recipe.
_base_ = './_base_/mask-rcnn_ttt_fpn_coco.py'
model = dict(
    backbone=dict(arch='small', drop_path_rate=0.4,
                  init_cfg=dict(type='Pretrained', checkpoint='data/H-ViTTT-S.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))

max_epochs = 36
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[27, 33], gamma=0.1),
]
