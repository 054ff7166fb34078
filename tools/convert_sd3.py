#!/usr/bin/env python
"""Convert a local SD3 / SD3.5 diffusers folder into SD3.5-T5 (see ttt_zoo/sd3/hub.py and docs/sd3.md).

    python tools/convert_sd3.py /path/to/stable-diffusion-3.5-medium ./sd3.5-medium-t5 \
        --base-name stabilityai/stable-diffusion-3.5-medium
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ttt_zoo.sd3.hub import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
