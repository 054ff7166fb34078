# UPerNet, plain ViT3-S with a ViTDet-style simple pyramid (strides 4..32), 160k, ADE20K 512x512.
# No official recipe exists for plain ViT3 segmentation; this uses the H-ViT3 recipe.
_base_ = './_base_/upernet_ttt_ade20k-512x512.py'
model = dict(
    backbone=dict(_delete_=True, type='TTTTimm', model_name='vit3_small', model_kwargs=dict(drop_path_rate=0.2),
                  init_cfg=dict(type='Pretrained', checkpoint='data/vit3_small.pth')),
    decode_head=dict(in_channels=[96, 192, 384, 384]),
    auxiliary_head=dict(in_channels=384))
