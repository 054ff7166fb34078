"""Run timm's own tests/test_models.py (from the pinned timm sdist) against the models ttt_zoo registers.

`make test` copies test_models.py next to this file; every test item whose ``model_name`` is not one of ours is
deselected, so the suite runs exactly timm's checks on exactly our models.
"""
import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="ttt_zoo_timm_suite_"))

import timm  # noqa: E402

import ttt_zoo  # noqa: E402,F401  (registers our models before test_models.py is collected)

OUR_MODELS = set(ttt_zoo.list_zoo_models())  # the image models (the diffusion ones take (x, t, y))
# The paper-variant models (vit3_*_v1, visionttt_*_la, ...) run the same code at every size: the suite checks
# their tiny size (set TTT_ZOO_TIMM_ALL_VARIANTS=1 for all sizes), which keeps `make test` within CI's time.
if not os.environ.get("TTT_ZOO_TIMM_ALL_VARIANTS"):
    OUR_MODELS = {m for m in OUR_MODELS if not ttt_zoo.is_variant_model(m) or "_tiny" in m}
_ONLY = os.environ.get("TTT_ZOO_TIMM_MODELS")
if _ONLY:
    OUR_MODELS &= set(_ONLY.split(","))


# These two download the released checkpoints from their URLs; tests never touch the network here (our own tests
# cover pretrained loading with checkpoint files they write: tests/test_pretrained_loading.py, tests/test_hub.py).
NEEDS_NETWORK = {"test_model_load_pretrained", "test_model_features_pretrained"}


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = str(params.get("model_name", "")).split(".")[0]  # some tests are parametrized with tagged names
        (keep if name in OUR_MODELS else drop).append(item)
    import pytest
    for item in keep:
        if item.originalname in NEEDS_NETWORK and not os.environ.get("TTT_ZOO_ALLOW_DOWNLOADS"):
            item.add_marker(pytest.mark.skip(reason="downloads released weights (no network in tests); "
                                                    "set TTT_ZOO_ALLOW_DOWNLOADS=1 to run"))
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
