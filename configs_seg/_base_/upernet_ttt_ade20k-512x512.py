# UPerNet on ADE20K (150 classes, 512x512 crops, 160k iterations) with a ttt_zoo backbone: the official
# H-ViT3 recipe (spec §7): AdamW 6e-5, wd 0.01, decay_mult 0 on 'norm' keys, LinearLR 1500 iters from 1e-6
# then PolyLR (power 1) to 0 at 160k, 2 images/GPU x 8 GPUs.
_base_ = [
    'mmseg::_base_/models/upernet_swin.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]
custom_imports = dict(imports=['ttt_zoo.adapters.mmseg'], allow_failed_imports=False)

crop_size = (512, 512)
data_root = 'data/ade/ADEChallengeData2016'
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    backbone=dict(_delete_=True, type='TTTHViT3', arch='tiny', drop_path_rate=0.2,
                  init_cfg=dict(type='Pretrained', checkpoint='data/H-ViTTT-T.pth')),
    decode_head=dict(in_channels=[64, 128, 320, 512], num_classes=150),
    auxiliary_head=dict(in_channels=320, num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='AmpOptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=dict(custom_keys={
        'absolute_pos_embed': dict(decay_mult=0.),
        'relative_position_bias_table': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.),
    }))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]
train_dataloader = dict(batch_size=2, dataset=dict(data_root=data_root))
val_dataloader = dict(batch_size=1, dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
