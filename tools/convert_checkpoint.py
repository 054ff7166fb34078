#!/usr/bin/env python
"""Convert checkpoints into Hugging Face Hub folders (same as `ttt-zoo convert`).

    python tools/convert_checkpoint.py CKPT --model vit3_tiny.in1k --out hub/vit3_tiny.in1k
    python tools/convert_checkpoint.py --all --checkpoint-dir ckpts --out-root hub
"""
import sys

from ttt_zoo.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
