"""A misspelled option raises instead of silently building the default model.  The check over every registered
model (an unknown top-level keyword and an unknown ``mixer_kwargs`` key raise TypeError naming the key and the
accepted ones) is a column of tests/test_registry_contract.py; here, the known ones still build."""
import timm
import torch


def _build(name, **kw):
    with torch.device("meta"):
        return timm.create_model(name, **kw)


def test_known_kwargs_still_build():
    m = _build("vit3_tiny", mixer_kwargs={"inner_steps": 2}, num_classes=5, in_chans=1, drop_path_rate=0.1)
    assert m.blocks[0].attn.inner_steps == 2 and m.num_classes == 5
    assert _build("hvit3_tiny", features_only=True, out_indices=(1, 2)) is not None
