"""The papers' ImageNet training settings as ``ttt-zoo train -c`` files (``ttt_zoo/train/recipes/*.yaml``).

Each key is the ``dest`` of a ``ttt-zoo train`` flag (``batch_size`` for ``-b``); each file's comments give the
paper's numbers and the section or table they come from, and say which values the paper does not state.

    ttt-zoo train -c vit3_tiny --data-dir /data/imagenet          # a recipe by name
    ttt-zoo train -c my_settings.yaml ...                         # or any YAML file of flag defaults
"""

import os
from typing import Any, Dict, List

__all__ = ["RECIPE_DIR", "list_recipes", "load_recipe", "resolve_config"]

RECIPE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")


def list_recipes() -> List[str]:
    """Names of the shipped recipes (file names without ``.yaml``)."""
    return sorted(f[:-5] for f in os.listdir(RECIPE_DIR) if f.endswith(".yaml"))


def _load_yaml(path: str) -> Dict[str, Any]:
    import yaml
    with open(path) as f:
        try:
            cfg = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {e}") from e
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a mapping of flag names to values, not a {type(cfg).__name__}.")
    return cfg


def load_recipe(name: str) -> Dict[str, Any]:
    """The recipe ``name`` (see :func:`list_recipes`) as a dict of ``ttt-zoo train`` flag defaults."""
    if name not in list_recipes():
        raise ValueError(f"no recipe named {name!r}; recipes: {', '.join(list_recipes())}")
    return _load_yaml(os.path.join(RECIPE_DIR, name + ".yaml"))


def resolve_config(name_or_path: str) -> Dict[str, Any]:
    """``-c/--config``: a YAML file path if one exists there, else a recipe name."""
    path = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isfile(path):
        return _load_yaml(path)
    name = os.path.basename(path)[:-5] if path.endswith(".yaml") and os.sep not in path else path
    if name in list_recipes():
        return load_recipe(name)
    raise ValueError(f"--config {name_or_path!r} is neither a YAML file nor a recipe name; recipes: "
                     f"{', '.join(list_recipes())}")
