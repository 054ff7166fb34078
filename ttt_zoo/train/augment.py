"""Training transforms: timm's ``create_transform`` with its posterize op made safe for current Pillow.

Why: timm 1.0.31's increasing posterize (``rand-...-inc1``, used by every classification recipe) keeps
``4 - int(4 * m / 10)`` bits, i.e. 0 bits at magnitude 10, which ``mstd`` noise reaches (about 0.15 % of the
augmentations of ``rand-m9-mstd0.5-inc1``); ``mmax`` > 10 gives fewer than 0.  The non-increasing ``Posterize``
gives 0 bits at magnitude 0.  In the original RandAugment (TensorFlow ``posterize``: shift right then left by
``8 - bits``) and in older Pillow, 0 bits is a black image; the pinned Pillow 13 raises ``ValueError`` (bits
must be 1..8), which killed every recipe's run within its first epoch.

The fix is local: :func:`guard_posterize` swaps the op function of the posterize ``AugmentOp`` instances inside one
transform (``AugmentOp.aug_fn`` is a per-instance attribute).  timm's op table is not patched, so a user's own
``timm.data.create_transform`` is unchanged.
"""
from __future__ import annotations

from typing import Any

from PIL import Image, ImageOps

__all__ = ["posterize", "guard_posterize", "create_train_transform"]


def posterize(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """timm's ``posterize`` with the original RandAugment's meaning of ``bits_to_keep <= 0``: a black image.

    1..7 bits: Pillow's ``ImageOps.posterize``; 8 or more: the image unchanged (as timm)."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep >= 1:
        return ImageOps.posterize(img, bits_to_keep)
    if img.mode not in ("L", "RGB"):  # the modes Pillow posterizes through a lookup table
        raise ValueError(f"posterize: image mode {img.mode} is not supported (L or RGB)")
    return img.point([0] * 256 * len(img.getbands()))  # every bit cleared


def _augment_ops(t: Any):
    """Every timm ``AugmentOp`` reachable from ``t``: Compose.transforms, RandAugment / AugMix .ops,
    AutoAugment .policy (a list of sub-policies)."""
    from timm.data.auto_augment import AugmentOp
    if isinstance(t, AugmentOp):
        yield t
        return
    for attr in ("transforms", "ops", "policy"):
        children = getattr(t, attr, None)
        if isinstance(children, (list, tuple)):
            for c in children:
                yield from _augment_ops(c)
    if isinstance(t, (list, tuple)):
        for c in t:
            yield from _augment_ops(c)


def guard_posterize(transform: Any) -> int:
    """Make every posterize op inside ``transform`` use :func:`posterize` (in place); returns how many."""
    from timm.data import auto_augment
    n = 0
    for op in _augment_ops(transform):
        if op.aug_fn is auto_augment.posterize or op.aug_fn is posterize:
            op.aug_fn = posterize
            n += 1
    return n


def create_train_transform(input_size, **kwargs: Any):
    """``timm.data.create_transform(input_size, is_training=True, **kwargs)`` with :func:`guard_posterize` applied."""
    from timm.data import create_transform
    t = create_transform(input_size, is_training=True, **kwargs)
    guard_posterize(t)
    return t
