"""Whole-model torch.compile (inductor, CPU, dynamic=True) equals eager, forward and backward, at a square and a
non-square size, for every family (one block per stage), and dynamo sees no graph break (marker ``compile``)."""
import os

import pytest

import ttt_zoo
from ttt_zoo.bench.compile import compiled_parity, graph_breaks, small_model

pytestmark = pytest.mark.compile
FAMILIES = sorted(ttt_zoo.list_zoo_families(include_diffusion=True))


# Vision-TTT's scan runs a Python loop over its 16-token mini-batches, which dynamo unrolls: at 224 px (196 tokens,
# two directions) one compile takes tens of minutes on 2 cores, so CI checks it on a few mini-batches
SCAN_SIZES = ((64, 64), (64, 96))


# known failures, each a row of tools/results/compile_graph_breaks.md
KNOWN = {
    # inductor's stride order of a view output cannot compare symbolic strides (torch 2.14); the CPE and
    # depthwise-conv cases are fixed (ttt_zoo/layers/block.py, kernels/vit3_ttt/torch.py), one H-ViT3 node is left
    "hvit3": "InductorError: cannot determine truth value of Relational: 64*s39*s89 < 64 (dynamic=True)",
}
# the Vision-TTT compile at the scan sizes is not yet measured on CI's machine: opt in with TTT_ZOO_COMPILE_SCAN=1
SCAN_OPT_IN = os.environ.get("TTT_ZOO_COMPILE_SCAN") == "1"


def _params():
    for f in FAMILIES:
        marks = []
        if f in KNOWN:
            marks.append(pytest.mark.xfail(reason=KNOWN[f], strict=False))
        if f.startswith("visionttt") and not SCAN_OPT_IN:
            marks.append(pytest.mark.skip(reason="Vision-TTT's unrolled scan: set TTT_ZOO_COMPILE_SCAN=1"))
        yield pytest.param(f, marks=marks)


@pytest.mark.parametrize("family", list(_params()))
def test_inductor_dynamic_matches_eager(family):
    name, model, sizes = small_model(family)
    if family.startswith("visionttt"):
        sizes = SCAN_SIZES
    breaks = graph_breaks(name, model, sizes[0])
    assert breaks["breaks"] == 0, f"{name}: graph breaks {breaks['reasons']}"
    res = compiled_parity(name, model, sizes)
    assert res["fwd"] < 1e-4 and res["grad"] < 1e-4, res
