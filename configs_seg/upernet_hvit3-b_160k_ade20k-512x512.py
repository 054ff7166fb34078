# UPerNet, H-ViT3-B backbone, 160k iterations, ADE20K 512x512. Spec §7 recipe.
_base_ = './_base_/upernet_ttt_ade20k-512x512.py'
model = dict(
    backbone=dict(arch='base', drop_path_rate=0.5,
                  init_cfg=dict(type='Pretrained', checkpoint='data/H-ViTTT-B.pth')),
    decode_head=dict(in_channels=[96, 192, 448, 640]),
    auxiliary_head=dict(in_channels=448))
# the official small/base runs train in fp32
optim_wrapper = dict(type='OptimWrapper')
