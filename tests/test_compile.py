"""Whole-model torch.compile equals eager, forward and backward, for every family (one block; two stages of the
hierarchical ones: ``ttt_zoo.bench.compile.SMALL``), and dynamo sees no graph break with symbolic sizes (marker
``compile``):
- inductor with static sizes (a first ``torch.compile`` call) at the non-square size;
- dynamo and AOT autograd with dynamic sizes (``aot_eager``, dynamic=True) at the non-square and then the square
  size.
Inductor's dynamic-size code generation (``compiled_parity``'s default) took 5x the static compile (Vision-TTT-H: 280
vs 55 s) and its backward guards on the concrete size, so two sizes compiled twice: 19.6 of CI's 40.8 test minutes.
Where the float32 runs part, eager float64 arbitrates: a ReLU input within float32 rounding of 0 (H-ViT3's stem at
160x256: one of 655360, at 1.8e-8) flips its gradient in one of them (``compiled_parity``)."""
import pytest

import ttt_zoo
from ttt_zoo.bench.compile import compiled_parity, graph_breaks, parity_ok, small_model

pytestmark = pytest.mark.compile
FAMILIES = sorted(ttt_zoo.list_zoo_families(include_diffusion=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_matches_eager(family):
    name, model, sizes = small_model(family)
    breaks = graph_breaks(name, model, sizes[0])
    assert breaks["breaks"] == 0, f"{name}: graph breaks {breaks['reasons']}"
    non_square, square = sizes
    assert non_square[0] != non_square[1] and square[0] == square[1]
    res = compiled_parity(name, model, [non_square], backend="inductor", dynamic=False)
    assert parity_ok(res, 1e-4), ("inductor", res)
    res = compiled_parity(name, model, sizes, backend="aot_eager", dynamic=True)
    assert parity_ok(res, 1e-4), ("aot_eager", res)
