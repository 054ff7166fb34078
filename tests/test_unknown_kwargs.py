"""A misspelled option raises instead of silently building the default model: for every registered model, an
unknown top-level keyword and an unknown ``mixer_kwargs`` key raise TypeError naming the key and the accepted ones
(built on the meta device: no weights are allocated)."""
import pytest
import timm
import torch

import ttt_zoo

NAMES = ttt_zoo.list_zoo_models(include_diffusion=True)


def _build(name, **kw):
    with torch.device("meta"):
        return timm.create_model(name, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_kwargs_raise(name):
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) \['depthh'\]; accepted: \[.*'depth") as e:
        _build(name, depthh=2)
    assert "mixer_kwargs" in str(e.value)  # the accepted ones are listed
    with pytest.raises(TypeError, match=r"mixer_kwargs\): unknown keyword argument\(s\) \['inner_stepss'\]; "
                                        r"accepted: \[.*'num_heads'") as e:
        _build(name, mixer_kwargs={"inner_stepss": 4})
    assert ("'inner_steps'" in str(e.value)) == (not name.startswith("dit_"))  # softmax DiT has no inner steps


def test_known_kwargs_still_build():
    m = _build("vit3_tiny", mixer_kwargs={"inner_steps": 2}, num_classes=5, in_chans=1, drop_path_rate=0.1)
    assert m.blocks[0].attn.inner_steps == 2 and m.num_classes == 5
    assert _build("hvit3_tiny", features_only=True, out_indices=(1, 2)) is not None
