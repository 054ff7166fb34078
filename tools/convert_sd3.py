#!/usr/bin/env python
"""Convert a local SD3 / SD3.5 diffusers folder into SD3.5-T5: ``ttt-zoo convert SRC --sd3 --out OUT`` (see
docs/sd3.md), spelt as before.

    python tools/convert_sd3.py /path/to/stable-diffusion-3.5-medium ./sd3.5-medium-t5 \
        --base-name stabilityai/stable-diffusion-3.5-medium
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ttt_zoo.cli import main  # noqa: E402


def run(argv=None) -> int:
    """``SRC OUT [options]`` -> ``ttt-zoo convert SRC --sd3 --out OUT [options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pos = [i for i, a in enumerate(argv) if not a.startswith("-") and (i == 0 or not argv[i - 1].startswith("--")
                                                                       or argv[i - 1] in ("--sd3", "--force"))]
    if len(pos) < 2 or any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip().splitlines()[0] + "\nusage: convert_sd3.py SRC OUT [ttt-zoo convert --sd3 options]")
        return 0 if any(a in ("-h", "--help") for a in argv) else 2
    src, out = argv[pos[0]], argv[pos[1]]
    rest = [a for i, a in enumerate(argv) if i not in pos[:2]]
    return main(["convert", src, "--sd3", "--out", out, *rest])


if __name__ == "__main__":
    raise SystemExit(run())
