"""Load the official golden fixtures (../shared/fixtures)."""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

FIXTURES = os.environ.get("TTT_ZOO_FIXTURES",
                          os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures"))


def load_fixture(name):
    path = os.path.join(FIXTURES, name + ".safetensors")
    if not os.path.exists(path):
        pytest.skip(f"fixture {path} not available (set TTT_ZOO_FIXTURES)")
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    state = {k[len("state_dict."):]: v for k, v in tensors.items() if k.startswith("state_dict.")}
    tol = json.loads(meta["tolerance"])
    return tensors, state, meta, dict(rtol=tol["rtol"], atol=tol["atol"])


def assert_classifier_matches(model, t, tol):
    """``model``'s pre-logits features and logits on the fixture's input equal the official ones (within ``tol``)."""
    x = t["input.x"]
    with torch.no_grad():
        feats = model.forward_head(model.forward_features(x), pre_logits=True)
        out = model(x)
    torch.testing.assert_close(feats, t["output_features"], **tol)
    torch.testing.assert_close(out, t["output"], **tol)
