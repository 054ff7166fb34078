"""Images as users have them, opened as the RGB the model expects: the EXIF orientation applied (a phone's portrait
photo is stored sideways; timm's loaders ignore the tag), 16-bit greyscale (PNG mode ``I;16`` / ``I``) scaled to 8
bits instead of clipped to white, palette images through their palette."""
from __future__ import annotations

__all__ = ["open_rgb", "to_rgb"]

_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def to_rgb(img):
    """``img`` (a PIL image) as an 8-bit RGB PIL image, upright."""
    import numpy as np
    from PIL import Image, ImageOps
    img = ImageOps.exif_transpose(img)
    if img.mode in _SIXTEEN_BIT:  # 0..65535 -> 0..255 (v / 257 rounded: 257 * k -> k exactly)
        a = np.asarray(img).astype(np.int64)
        img = Image.fromarray(((a + 128) // 257).clip(0, 255).astype(np.uint8), "L")
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # the palette's colours; PIL warns when P with transparency goes to RGB directly
    return img.convert("RGB")


def open_rgb(path: str):
    """The image file ``path`` as :func:`to_rgb` gives it (read completely, the file closed)."""
    from PIL import Image
    with Image.open(path) as img:
        return to_rgb(img)
