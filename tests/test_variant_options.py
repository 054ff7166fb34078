"""The paper-variant options have one home, ``ttt_zoo/layers/variants.py``: every mixer that takes them checks them
there, so a bool ``inner_steps`` is refused alike by every mixer, at construction, by ``set_inner_steps`` and on
assignment, and by every family built with it."""
import inspect

import numpy as np
import pytest
import torch

import ttt_zoo
from ttt_zoo.layers import mixer as mixer_mod
from ttt_zoo.layers.mixer import create_mixer, list_mixers
from ttt_zoo.layers.variants import VARIANT_OPTIONS, VariantOptions

BAD_STEPS = [True, False, 0, -1, 2.0, 1.5, "2", None]
MESSAGE = r"inner_steps must be an integer >= 1 \(1, 2, 3, \.\.\.; not a bool or a float\), got "


def _takes_variant_options(name):
    return "inner_steps" in inspect.signature(mixer_mod._MIXERS[name]).parameters


VARIANT_MIXERS = [m for m in list_mixers() if _takes_variant_options(m)]


def test_every_mixer_with_variant_options_takes_all_of_them_from_one_home():
    assert set(VARIANT_MIXERS) >= {"vit3", "t5", "dit5_mixed", "ttt_linear"}
    for name in list_mixers():
        cls, params = mixer_mod._MIXERS[name], inspect.signature(mixer_mod._MIXERS[name]).parameters
        if name in VARIANT_MIXERS:
            assert issubclass(cls, VariantOptions) and set(VARIANT_OPTIONS) <= set(params), name
        else:  # a mixer takes all the variant options or none
            assert not set(VARIANT_OPTIONS) & set(params), name


@pytest.mark.parametrize("name", VARIANT_MIXERS)
def test_bad_inner_steps_refused_by_every_mixer(name):
    for steps in BAD_STEPS:
        with pytest.raises(ValueError, match=MESSAGE + repr(steps).replace(".", r"\.")):
            create_mixer(name, 16, num_heads=2, inner_steps=steps)
    m = create_mixer(name, 16, num_heads=2, inner_steps=1)
    for steps in (True, False, 2.0):
        with pytest.raises(ValueError, match=MESSAGE):
            m.set_inner_steps(steps)
        with pytest.raises(ValueError, match=MESSAGE):
            m.inner_steps = steps
    assert m.inner_steps == 1 and type(m.inner_steps) is int


@pytest.mark.parametrize("name", VARIANT_MIXERS)
def test_good_inner_steps_still_taken(name):
    kw = dict(inner_loss="dot") if name == "ttt_linear" else {}  # k steps only on its dot loss (its own rule)
    m = create_mixer(name, 16, num_heads=2, inner_steps=3, **kw)
    assert m.inner_steps == 3
    m.set_inner_steps(np.int64(2))  # a NumPy integer is a whole number too
    assert m.inner_steps == 2 and type(m.inner_steps) is int


FAMILIES = sorted(ttt_zoo.list_zoo_families(include_diffusion=True).values())
VARIANT_MODELS = sorted(n for n in ttt_zoo.list_zoo_models(include_diffusion=True) if ttt_zoo.is_variant_model(n)
                        and "_tiny_" in n)


@pytest.mark.parametrize("model", FAMILIES + VARIANT_MODELS)
@pytest.mark.parametrize("steps", [True, False])
def test_bool_inner_steps_refused_by_every_family(model, steps):
    """Every family (its smallest model) and every tiny paper-variant model refuses a bool ``inner_steps``: a
    ValueError naming the option from its mixer, or, where the family's mixer takes no variant options (DiT's
    softmax attention), the unknown-option TypeError."""
    try:
        with torch.device("meta"):
            ttt_zoo.create_model(model, mixer_kwargs=dict(inner_steps=steps))
    except ValueError as e:
        assert str(e).endswith(f"inner_steps must be an integer >= 1 (1, 2, 3, ...; not a bool or a float), "
                               f"got {steps!r}"), str(e)
    except TypeError as e:
        assert "unknown keyword argument(s) ['inner_steps']" in str(e), str(e)
        assert not any(f"mixer {m!r}" in str(e) for m in VARIANT_MIXERS), str(e)
    else:
        pytest.fail(f"{model} accepted inner_steps={steps!r}")
