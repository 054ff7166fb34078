"""scikit-learn's bundled digits (1797 8x8 grey images, no download) as a timm/torchvision ImageFolder.

    root/train/<0..9>/NNNN.png, root/val/<0..9>/NNNN.png     RGB PNGs upsampled (bicubic) to img_size
    root/digits.json                                          the parameters and counts; written last

The folder is built in a temporary folder beside ``root`` and renamed into place, so ``root`` is either absent or
complete. An existing complete folder with the same parameters is reused; anything else at ``root`` is refused.
"""

import json
import os
import shutil
import tempfile

import numpy as np

__all__ = ["make_digits_folder", "model_kwargs_flags", "MANIFEST", "SMALL_MODELS"]

MANIFEST = "digits.json"

# key -> (the shipped `ttt-zoo train -c` recipe, description): small versions of each family that train on the CPU
# in a minute or two.  The recipes (ttt_zoo/train/recipes/digits_*.yaml) hold every setting; the demo, the README
# table and experiments/digits_runs.py all run them.
SMALL_MODELS = {
    "vit3": ("digits_vit3", "ViT3, 4 blocks, width 96"),
    "hvit3": ("digits_hvit3", "H-ViT3, 4 stages, widths 32-256"),
    "visionttt": ("digits_visionttt", "Vision-TTT, 4 blocks, width 96"),
    "deit": ("digits_deit", "DeiT (timm, softmax attention), 4 blocks, width 96"),
}


def model_kwargs_flags(kwargs) -> list:
    """``--model-kwargs k=v ...`` for ``kwargs`` as timm's ParseKwargs reads them back (the command line replaces a
    recipe's whole ``model_kwargs``: pass them all, plus what you add)."""
    return ["--model-kwargs", *(f"{k}={v!r}".replace(" ", "") for k, v in kwargs.items())]


def _load():
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise ImportError("the digits data set comes from scikit-learn: pip install scikit-learn") from e
    d = load_digits()
    return d.images, d.target, train_test_split


def _write(tmp: str, img_size: int, val_fraction: float, seed: int) -> dict:
    from PIL import Image
    images, target, train_test_split = _load()
    idx = np.arange(len(target))
    train_idx, val_idx = train_test_split(idx, test_size=val_fraction, random_state=seed, stratify=target)
    counts = {}
    for split, ids in (("train", train_idx), ("val", val_idx)):
        for c in range(10):
            os.makedirs(os.path.join(tmp, split, str(c)))
        for i in sorted(ids):
            grey = np.round(images[i] * (255.0 / 16.0)).astype(np.uint8)  # digits pixels are 0..16
            im = Image.fromarray(grey, mode="L")
            if img_size != grey.shape[0]:
                im = im.resize((img_size, img_size), Image.Resampling.BICUBIC)
            im.convert("RGB").save(os.path.join(tmp, split, str(int(target[i])), f"{i:04d}.png"))
        counts[split] = {str(c): int((target[ids] == c).sum()) for c in range(10)}
    return counts


def _read_manifest(root: str):
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _check_existing(root: str, params: dict) -> str:
    meta = _read_manifest(root)
    if meta is None:
        raise FileExistsError(f"{root} exists but is not a complete digits folder (no valid {MANIFEST}): remove it "
                              "or choose another --out")
    got = {k: meta.get(k) for k in params}
    if got != params:
        raise FileExistsError(f"{root} holds a digits folder made with {got}, not {params}: remove it or choose "
                              "another --out")
    return root


def make_digits_folder(root: str, img_size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> str:
    """Write (or reuse) the digits ImageFolder at ``root`` and return ``root``.

    Classes are the folder names "0".."9"; the train/val split is stratified by class (scikit-learn's
    ``train_test_split`` with ``random_state=seed``).
    """
    if int(img_size) != img_size or img_size < 1:
        raise ValueError(f"img_size must be a positive integer, got {img_size!r}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction!r}")
    root = os.path.abspath(os.fspath(root))
    params = dict(img_size=int(img_size), val_fraction=float(val_fraction), seed=int(seed))
    if os.path.lexists(root):
        return _check_existing(root, params)
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(root)}.tmp-", dir=parent)
    try:
        counts = _write(tmp, **params)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(dict(params, source="sklearn.datasets.load_digits", counts=counts), f, indent=1)
        try:
            os.rename(tmp, root)
        except OSError:
            if not os.path.lexists(root):
                raise
            return _check_existing(root, params)  # another process finished first (e.g. every torchrun rank)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return root
