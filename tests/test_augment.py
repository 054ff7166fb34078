"""ttt_zoo.train.augment: the training transform's posterize keeps timm's meaning (0 bits = a black image, as in
the original RandAugment) where the pinned Pillow refuses 0 bits; every op of the recipes' policy runs at magnitude 10."""
import os
import random

import numpy as np
import pytest
from PIL import Image, ImageOps

from ttt_zoo.train.augment import create_train_transform, guard_posterize, posterize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = "rand-m9-mstd0.5-inc1"  # every classification recipe's --aa


@pytest.fixture(scope="module")
def chelsea():
    return Image.open(os.path.join(ROOT, "ttt_zoo", "assets", "chelsea.jpg")).convert("RGB")


def _rand_augment(policy, **kw):
    """The RandAugment inside the training pipeline's transform (the same builder as ``ttt-zoo train``)."""
    from timm.data.auto_augment import RandAugment
    t = create_train_transform(224, auto_augment=policy, **kw)
    found = [s for s in t.transforms if isinstance(s, RandAugment)]
    assert len(found) == 1, t
    return found[0]


def _posterize_reference(img, bits):
    """Keep the top ``bits`` bits of each channel, in numpy (bits <= 0 clears all)."""
    a = np.asarray(img)
    mask = 0 if bits <= 0 else (0xFF << (8 - min(bits, 8))) & 0xFF
    return a & np.uint8(mask)


def test_posterize_matches_pillow_and_gives_black_at_zero_bits(chelsea):
    for bits in range(1, 9):
        ours = posterize(chelsea, bits)
        assert np.array_equal(np.asarray(ours), np.asarray(ImageOps.posterize(chelsea, bits))), bits
        assert np.array_equal(np.asarray(ours), _posterize_reference(chelsea, bits)), bits
    for bits in (0, -1, -6):
        out = posterize(chelsea, bits)
        assert out.mode == "RGB" and out.size == chelsea.size
        assert not np.asarray(out).any()  # black
    gray = chelsea.convert("L")
    assert not np.asarray(posterize(gray, 0)).any() and posterize(gray, 0).mode == "L"
    assert np.asarray(chelsea).any()


@pytest.mark.parametrize("magnitude, mmax", [(10, None), (30, 30)])
def test_every_op_of_the_recipe_policy_at_max_magnitude(chelsea, magnitude, mmax):
    """Each op of rand-m9-mstd0.5-inc1 applied (p=1) at magnitude 10, timm's upper bound for this policy, and at
    30 with mmax30 (bits < 0): all run; posterize gives a black image; the other ops change the image."""
    random.seed(0)
    ra = _rand_augment(POLICY + (f"-mmax{mmax}" if mmax else ""))
    names = [op.name for op in ra.ops]
    from timm.data.auto_augment import _RAND_INCREASING_TRANSFORMS
    assert names == list(_RAND_INCREASING_TRANSFORMS) and "PosterizeIncreasing" in names
    for op in ra.ops:
        op.prob, op.magnitude, op.magnitude_std = 1.0, magnitude, 0.0
        out = op(chelsea)
        assert out.size == chelsea.size and out.mode == "RGB", op.name
        a = np.asarray(out)
        if op.name == "PosterizeIncreasing":
            assert op.level_fn(magnitude, op.hparams)[0] <= 0  # timm asks for 0 (or fewer) bits here
            assert not a.any(), "0-bit posterize must give a black image"
        else:
            assert not np.array_equal(a, np.asarray(chelsea)), op.name


def test_whole_policy_with_noise_runs_on_many_draws(chelsea):
    """The full transform, seeded, with magnitude noise: it reaches magnitude 10 on some draws."""
    random.seed(1)
    np.random.seed(1)
    t = create_train_transform(32, auto_augment="rand-m9-mstd0.5-inc1-n4-p1.0", re_prob=0.25)
    for _ in range(200):
        x = t(chelsea)
        assert tuple(x.shape) == (3, 32, 32)


def test_guard_reaches_every_timm_policy_kind():
    """RandAugment (increasing and not), AutoAugment and AugMix: every posterize op is swapped, nothing else."""
    from timm.data import auto_augment as aa
    for policy, expect in (("rand-m9-mstd0.5-inc1", 1), ("rand-m9-mstd0.5", 1), ("original", None),
                           ("v0", None), ("augmix-m5-w3", 1)):
        t = create_train_transform(64, auto_augment=policy)
        ops = [op for op in _walk(t)]
        post = [op for op in ops if "Posterize" in op.name]
        assert post and all(op.aug_fn is posterize for op in post), policy
        assert all(op.aug_fn is not posterize for op in ops if "Posterize" not in op.name), policy
        if expect is not None:
            assert len(post) == expect, policy
        assert guard_posterize(t) == len(post)  # idempotent
    # timm itself is untouched: its own transform still uses its own op
    plain = aa.rand_augment_transform(POLICY, {})
    assert [op.aug_fn for op in plain.ops if op.name == "PosterizeIncreasing"] == [aa.posterize]


def test_non_increasing_posterize_at_magnitude_zero(chelsea):
    """The other direction: plain ``Posterize`` keeps int(4 * m / 10) bits, 0 at magnitude 0."""
    ra = _rand_augment("rand-m0-mstd0")
    op = next(op for op in ra.ops if op.name == "Posterize")
    op.prob = 1.0
    assert op.level_fn(0, op.hparams) == (0,)
    assert not np.asarray(op(chelsea)).any()


def _walk(t):
    from ttt_zoo.train.augment import _augment_ops
    return list(_augment_ops(t))
