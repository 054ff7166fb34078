"""Whole-model torch.compile (inductor, CPU, dynamic=True) equals eager, forward and backward, at a square and a
non-square size, for every family (one block; two stages of the hierarchical ones: ``ttt_zoo.bench.compile.SMALL``),
and dynamo sees no graph break with symbolic sizes (marker ``compile``).  Where the float32 runs part, eager float64
arbitrates: a ReLU input within float32 rounding of 0 (H-ViT3's stem at 160x256: one of 655360, at 1.8e-8) flips its
gradient in one of them (``compiled_parity``)."""
import pytest

import ttt_zoo
from ttt_zoo.bench.compile import compiled_parity, graph_breaks, parity_ok, small_model

pytestmark = pytest.mark.compile
FAMILIES = sorted(ttt_zoo.list_zoo_families(include_diffusion=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_inductor_dynamic_matches_eager(family):
    name, model, sizes = small_model(family)
    breaks = graph_breaks(name, model, sizes[0])
    assert breaks["breaks"] == 0, f"{name}: graph breaks {breaks['reasons']}"
    res = compiled_parity(name, model, sizes)
    assert parity_ok(res, 1e-4), res
