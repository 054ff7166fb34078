"""ttt_zoo.train.digits / ``ttt-zoo data digits``: sklearn's digits as an ImageFolder."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("sklearn")
from PIL import Image  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from ttt_zoo.cli import main  # noqa: E402
from ttt_zoo.train.digits import MANIFEST, make_digits_folder  # noqa: E402


def _files(root, split):
    return {c: sorted(os.listdir(os.path.join(root, split, c))) for c in sorted(os.listdir(os.path.join(root, split)))}


def test_digits_folder_layout_split_and_pixels(tmp_path):
    d = load_digits()
    root = make_digits_folder(str(tmp_path / "d8"), img_size=8, val_fraction=0.2, seed=0)
    tr, va = _files(root, "train"), _files(root, "val")
    assert sorted(tr) == sorted(va) == [str(c) for c in range(10)]
    ids = [int(f[:4]) for fs in list(tr.values()) + list(va.values()) for f in fs]
    assert sorted(ids) == list(range(1797))  # every image exactly once
    for c in range(10):
        n = int((d.target == c).sum())
        assert abs(len(va[str(c)]) - 0.2 * n) <= 1  # stratified
        for f in tr[str(c)][:3] + va[str(c)][:3]:
            assert d.target[int(f[:4])] == c
    # at img_size 8 there is no resampling: every channel equals the 0..16 pixels scaled to 0..255
    f = tr["3"][0]
    im = np.asarray(Image.open(os.path.join(root, "train", "3", f)))
    assert im.shape == (8, 8, 3)
    ref = np.round(d.images[int(f[:4])] * 255 / 16)
    for ch in range(3):
        np.testing.assert_array_equal(im[..., ch], ref)
    assert json.load(open(os.path.join(root, MANIFEST)))["counts"]["val"]["3"] == len(va["3"])


def test_digits_upsampled_and_reused(tmp_path):
    d = load_digits()
    out = str(tmp_path / "d32")
    assert main(["data", "digits", "--out", out, "--img-size", "32"]) == 0
    f = sorted(os.listdir(os.path.join(out, "val", "7")))[0]
    im = np.asarray(Image.open(os.path.join(out, "val", "7", f)).convert("L"), dtype=np.float64)
    assert im.shape == (32, 32)
    blocks = im.reshape(8, 4, 8, 4).mean(axis=(1, 3))  # bicubic upsampling keeps the 4x4 block means close
    ref = d.images[int(f[:4])] * 255 / 16
    assert np.corrcoef(blocks.ravel(), ref.ravel())[0, 1] > 0.95
    # a second call reuses the complete folder and rewrites nothing
    mtime = os.path.getmtime(os.path.join(out, MANIFEST))
    assert make_digits_folder(out, img_size=32) == os.path.abspath(out)
    assert os.path.getmtime(os.path.join(out, MANIFEST)) == mtime
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # no temporary folder left behind
    with pytest.raises(FileExistsError, match="img_size"):
        make_digits_folder(out, img_size=16)  # a different folder is not silently reused


def test_digits_refuses_incomplete_folder(tmp_path):
    bad = tmp_path / "partial"
    (bad / "train" / "0").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="not a complete digits folder"):
        make_digits_folder(str(bad))
    with pytest.raises(SystemExit, match="not a complete digits folder"):
        main(["data", "digits", "--out", str(bad)])
    with pytest.raises(ValueError, match="val_fraction"):
        make_digits_folder(str(tmp_path / "x"), val_fraction=1.5)
