"""Whole-model torch.compile equals eager, forward and backward, for every family (one block; two stages of the
hierarchical ones: ``ttt_zoo.bench.compile.SMALL``), and dynamo sees no graph break with symbolic sizes (marker
``compile``):
- inductor with static sizes (a first ``torch.compile`` call) at the non-square size;
- dynamo and AOT autograd with dynamic sizes (``aot_eager``, dynamic=True) at the non-square and then the square
  size.
Inductor's dynamic-size code generation (``compiled_parity``'s default) took 5x the static compile (Vision-TTT-H: 280
vs 55 s) and its backward guards on the concrete size, so two sizes compiled twice: 19.6 of CI's 40.8 test minutes.
Where the float32 runs part, eager float64 arbitrates: a ReLU input within float32 rounding of 0 (H-ViT3's stem at
160x256: one of 655360, at 1.8e-8) flips its gradient in one of them (``compiled_parity``).
At full depth (each family's smallest registered model as registered), explain finds no break and two training
steps of one size do not recompile; ``ttt-zoo train / validate / predict / sample --torchcompile eager`` give the
eager numbers and checkpoints without ``_orig_mod.``."""
import os

import numpy as np
import pytest

import ttt_zoo
from ttt_zoo.bench.compile import block_counts, compiled_parity, full_depth_check, graph_breaks, parity_ok, small_model

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


# ----- --torchcompile (timm's flag) at full depth, and through the commands -----

@pytest.mark.parametrize("family", FAMILIES)
def test_full_depth_no_break_no_recompile(family):
    """The family's smallest registered model at its own depth and widths: two training steps of one size through
    ``compile_model`` (static sizes, as ``--torchcompile --torchcompile-mode reduce-overhead`` traces a first call)
    compile one graph, with no break, once (backend eager: dynamo alone; inductor and CUDA graphs compile what dynamo
    hands them).  ``experiments/results/compile_full_depth.md`` has the table, with ``torch._dynamo.explain`` too;
    here dynamo's counters stand in for explain (``test_recompile_is_counted`` checks they see a break)."""
    import timm
    r = full_depth_check(family, explain=False)
    assert r["depth"] == block_counts(timm.create_model(r["model"])) and sum(np.atleast_1d(r["depth"])) >= 12, r
    assert r["breaks"] == 0 and r["graphs"] == 1, (r["model"], r["reasons"])
    assert r["graphs_per_step"] == [1, 1], (r["model"], "recompiled at the second step", r["graphs_per_step"])


def test_recompile_is_counted():
    """The count full_depth_check reads sees a recompile (a second input size) and a graph break."""
    import torch
    from ttt_zoo.torchcompile import compile_model

    class Breaks(torch.nn.Module):
        def forward(self, x):
            x = x * 2
            torch._dynamo.graph_break()
            return x + 1

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = compile_model(torch.nn.Linear(3, 3), "eager")
    f(torch.randn(2, 3))
    f(torch.randn(2, 3))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    f(torch.randn(5, 3))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
    assert torch._dynamo.explain(Breaks())(torch.randn(2)).graph_break_count == 1
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_model(Breaks(), "eager")(torch.randn(2))  # what full_depth_check(explain=False) reads
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert len(torch._dynamo.utils.counters["graph_break"]) == 1, dict(torch._dynamo.utils.counters["graph_break"])


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from _train_data import make_tiny_digits
    return make_tiny_digits(str(tmp_path_factory.mktemp("digits")))


def _cli(*argv):
    from ttt_zoo.cli import main
    return main([str(a) for a in argv])


def test_commands_with_torchcompile_match_eager(digits, tmp_path, capsys):
    """``ttt-zoo train / validate / predict / sample --torchcompile eager``: the same weights, numbers and samples
    as without; the checkpoints (weights and EMA) have the model's own keys (no ``_orig_mod.``)."""
    import json

    import torch
    from safetensors.torch import load_file
    from test_cli_errors import TINY
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["--torchcompile", "eager"])):
        assert _cli("train", "--data-dir", digits, "--output", tmp_path, *TINY, "--epochs", "1", "--model-ema",
                    "--experiment", name, *extra) == 0
        runs[name] = tmp_path / name
    import timm
    keys = set(timm.create_model("vit3_tiny", depth=1, embed_dim=16, num_heads=2, patch_size=4, img_size=16,
                                 num_classes=10).state_dict())
    for tag in ("last", "last_ema"):
        eager, compiled = (load_file(runs[n] / f"{tag}.safetensors") for n in ("eager", "compiled"))
        assert set(compiled) == keys and not any("_orig_mod" in k for k in compiled)
        for k in keys:  # the eager backend runs the same aten ops: the same training
            torch.testing.assert_close(compiled[k], eager[k], rtol=1e-5, atol=1e-6, msg=k)
    capsys.readouterr()

    def numbers(*argv):
        out = {}
        for name, extra in (("eager", []), ("compiled", ["--torchcompile", "eager"])):
            res = tmp_path / f"{argv[0]}-{name}.json"
            assert _cli(*argv, "--results-file", res, *extra) == 0
            out[name] = json.loads(res.read_text())
        return out

    v = numbers("validate", "--checkpoint", runs["compiled"] / "last.safetensors", "--data-dir", digits, "-j", "0",
                "--use-ema")
    assert v["compiled"] == v["eager"] and v["eager"][0]["top1"] > 0
    p = numbers("predict", os.path.join(digits, "val"), "--checkpoint", runs["compiled"], "-j", "0", "--topk", "3",
                "--output-type", "logit", "-b", "7", "--no-console-results")
    assert len(p["eager"]) == 20 and p["compiled"].keys() == p["eager"].keys()  # batches 7, 7, 6: two sizes
    for f, row in p["eager"].items():  # (the compiled graph may order a sum differently: the last bit moves)
        assert p["compiled"][f]["label"] == row["label"], f
        torch.testing.assert_close(p["compiled"][f]["logit"], row["logit"], rtol=1e-5, atol=1e-7, msg=f)
    pngs = []
    for extra in ([], ["--torchcompile", "eager"]):
        out = tmp_path / f"s{len(pngs)}.png"
        assert _cli("sample", "--model", "dit3_s_2", "--tiny", "--steps", "2", "--labels", "1", "2", "--out", out,
                    *extra) == 0
        pngs.append(out.read_bytes())
    assert pngs[0] == pngs[1]
