# Mask R-CNN + FPN, plain ViT3-S with a ViTDet-style simple pyramid (strides 4..32), 1x, COCO.
# No official recipe exists for plain ViT3 detection; this uses the H-ViT3 1x recipe.
_base_ = './_base_/mask-rcnn_ttt_fpn_coco.py'
model = dict(
    backbone=dict(_delete_=True, type='TTTTimm', model_name='vit3_small', model_kwargs=dict(drop_path_rate=0.1),
                  with_cp=True, init_cfg=dict(type='Pretrained', checkpoint='data/vit3_small.pth')),
    neck=dict(in_channels=[96, 192, 384, 384]))
