# UPerNet, hierarchical Vision-TTT (Vittt-H-S), 160k, ADE20K 512x512, through TTTTimm.
# The paper gives no segmentation recipe for Vittt; this is the H-ViT3 recipe.
_base_ = './_base_/upernet_ttt_ade20k-512x512.py'
model = dict(
    backbone=dict(_delete_=True, type='TTTTimm', model_name='visionttt_h_small', model_kwargs=dict(drop_path_rate=0.2),
                  init_cfg=dict(type='Pretrained', checkpoint='data/visionttt_h_small.pth')),
    decode_head=dict(in_channels=[96, 192, 384, 768]),
    auxiliary_head=dict(in_channels=384))
