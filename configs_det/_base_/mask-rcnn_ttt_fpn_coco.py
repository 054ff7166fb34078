# Mask R-CNN + FPN on COCO with a ttt_zoo backbone: the official H-ViT3 recipe (spec §7).
# AdamW 2e-4, wd 0.05, decay_mult 0 on 'norm' keys, AMP, DETR-style multi-scale + crop, 4 images/GPU x 8 GPUs.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['ttt_zoo.adapters.mmdet'], allow_failed_imports=False)

data_root = 'data/coco/'
model = dict(
    backbone=dict(_delete_=True, type='TTTHViT3', arch='tiny', drop_path_rate=0.1, use_checkpoint=True,
                  init_cfg=dict(type='Pretrained', checkpoint='data/H-ViTTT-T.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))

_scales = [(480, 1333), (512, 1333), (544, 1333), (576, 1333), (608, 1333), (640, 1333), (672, 1333),
           (704, 1333), (736, 1333), (768, 1333), (800, 1333)]
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='RandomChoice', transforms=[
        [dict(type='RandomChoiceResize', scales=_scales, keep_ratio=True)],
        [dict(type='RandomChoiceResize', scales=[(400, 1333), (500, 1333), (600, 1333)], keep_ratio=True),
         dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600), allow_negative_crop=True),
         dict(type='RandomChoiceResize', scales=_scales, keep_ratio=True)],
    ]),
    dict(type='PackDetInputs'),
]
train_dataloader = dict(batch_size=4, num_workers=4,
                        dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(batch_size=2, dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator

max_epochs = 12
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[8, 11], gamma=0.1),
]
optim_wrapper = dict(
    type='AmpOptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={
        'absolute_pos_embed': dict(decay_mult=0.),
        'relative_position_bias_table': dict(decay_mult=0.),
        'norm': dict(decay_mult=0.),
    }))
# 8 GPUs x 4 images
auto_scale_lr = dict(enable=False, base_batch_size=32)
