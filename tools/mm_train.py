"""Train a configs_det/ or configs_seg/ config with mmdet's / mmseg's own tools/train.py.

  python tools/mm_train.py configs_det/mask-rcnn_hvit3-t_fpn_1x_coco.py [--work-dir DIR] [--cfg-options k=v ...]
  torchrun --nproc_per_node 8 tools/mm_train.py CONFIG --launcher pytorch      # multi-GPU
  torchrun --nproc_per_node 2 tools/mm_train.py CONFIG --launcher pytorch      # no CUDA: CPU processes, gloo
  --trust-checkpoint: opt in (trusted files only) to fully unpickling an mmengine checkpoint
"""
from mm_tools import main

if __name__ == "__main__":
    main("train")
