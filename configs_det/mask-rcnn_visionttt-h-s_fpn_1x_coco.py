# Mask R-CNN + FPN, hierarchical Vision-TTT (Vittt-H-S), 1x, COCO. Uses the timm model through TTTTimm.
# The paper gives no detection recipe for Vittt; this is the H-ViT3 1x recipe.
_base_ = './_base_/mask-rcnn_ttt_fpn_coco.py'
model = dict(
    backbone=dict(_delete_=True, type='TTTTimm', model_name='visionttt_h_small', model_kwargs=dict(drop_path_rate=0.1),
                  with_cp=True, init_cfg=dict(type='Pretrained', checkpoint='data/visionttt_h_small.pth')),
    neck=dict(in_channels=[96, 192, 384, 768]))
