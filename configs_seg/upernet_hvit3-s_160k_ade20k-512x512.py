# UPerNet, H-ViT3-S backbone, 160k iterations, ADE20K 512x512. Spec §7 recipe.
_base_ = './_base_/upernet_ttt_ade20k-512x512.py'
model = dict(
    backbone=dict(arch='small', drop_path_rate=0.4,
                  init_cfg=dict(type='Pretrained', checkpoint='data/H-ViTTT-S.pth')),
    decode_head=dict(in_channels=[64, 128, 320, 512]),
    auxiliary_head=dict(in_channels=320))
# the official small/base runs train in fp32
optim_wrapper = dict(type='OptimWrapper')
