"""Generate ``ttt_zoo/assets/model_stats.json``: parameters and GFLOPs of every registered model at the default
size (what ``ttt-zoo list`` prints), measured on the meta device.  Rerun after adding or changing a model;
``tests/test_model_stats.py`` fails until the table matches the registry and the models.

    python tools/gen_model_stats.py
"""
import json
import sys

import torch


def build_table():
    import ttt_zoo
    from ttt_zoo.cli.list import DEFAULT_IMG_SIZE, model_stats
    models = {n: model_stats(n, DEFAULT_IMG_SIZE) for n in ttt_zoo.list_zoo_models(include_diffusion=True)}
    return {"img_size": DEFAULT_IMG_SIZE, "torch": torch.__version__.split("+")[0], "models": models}


def write_atomic(path: str, text: str) -> None:
    from ttt_zoo.fileio import atomic_write
    atomic_write(path, text)


def main() -> int:
    from ttt_zoo.cli.list import STATS_FILE
    table = build_table()
    write_atomic(STATS_FILE, json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(table['models'])} models to {STATS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
