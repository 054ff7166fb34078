"""A tiny image folder of real data for the training tests: sklearn's bundled digits, a few images per class."""
import os

import numpy as np


def make_tiny_digits(root: str, train_per_class: int = 4, val_per_class: int = 2, img_size: int = 16) -> str:
    """root/train/<c>/*.png and root/val/<c>/*.png (RGB, upsampled); returns root."""
    from PIL import Image
    from sklearn.datasets import load_digits
    d = load_digits()
    for c in range(10):
        idx = np.flatnonzero(d.target == c)
        for split, ids in (("train", idx[:train_per_class]), ("val", idx[train_per_class:train_per_class + val_per_class])):
            os.makedirs(os.path.join(root, split, str(c)), exist_ok=True)
            for i in ids:
                img = Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).resize((img_size, img_size),
                                                                                        Image.BICUBIC)
                img.convert("RGB").save(os.path.join(root, split, str(c), f"{i:04d}.png"))
    return root
