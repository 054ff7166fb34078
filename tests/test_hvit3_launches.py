"""H-ViT3's 2-D RoPE tables are cached in eager (issue 48): the cache gives the tables the build gives, follows the
map size, survives inference_mode, adds no state-dict key, and is bypassed under tracing; on the Triton path the
rotation runs inside the fused kernels."""
import pytest
import timm
import torch

from _ops import triton_test

from ttt_zoo.kernels import rope
from ttt_zoo.kernels.backend import use_backend
from ttt_zoo.bench.launches import block_launches


def _reference_tables(h, w, dim, base=10000.0):
    """float64 angles of the official 2-D RoPE: pair p < dim/4 turns by row * theta_p, the rest by col."""
    k = dim // 4
    theta = base ** (-torch.arange(k, dtype=torch.float64) / k)
    rows = torch.arange(h, dtype=torch.float64)[:, None, None].expand(h, w, 1)
    cols = torch.arange(w, dtype=torch.float64)[None, :, None].expand(h, w, 1)
    ang = torch.cat([rows * theta, cols * theta], -1)
    return ang.cos(), ang.sin()


def test_cached_tables_equal_the_build_and_follow_the_size():
    for h, w, dim in [(4, 6, 64), (7, 5, 64), (4, 6, 32)]:
        cos, sin = rope.rope_2d_tables((h, w), dim)
        again = rope.rope_2d_tables((h, w), dim)
        assert again[0] is cos and again[1] is sin  # no rebuild
        built = rope._build_rope_2d_tables(h, w, dim, 10000.0, None)
        assert torch.equal(cos, built[0]) and torch.equal(sin, built[1])
        ref_cos, ref_sin = _reference_tables(h, w, dim)
        assert cos.shape == (h, w, dim // 2)
        torch.testing.assert_close(cos.double(), ref_cos, atol=2e-6, rtol=0)
        torch.testing.assert_close(sin.double(), ref_sin, atol=2e-6, rtol=0)


def test_cached_turn_gives_the_uncached_rotation():
    cos, sin = rope.rope_2d_tables((5, 3), 32, base=100.0)
    x = torch.randn(2, 5, 3, 32)
    cached = rope.rope_2d(x, cos, sin)
    uncached = rope.rope_2d(x, cos.clone(), sin.clone())  # not the cache's tensors: the turn is built
    assert torch.equal(cached, uncached)


def test_tables_built_in_inference_mode_serve_a_training_step():
    with torch.inference_mode():
        cos, _ = rope.rope_2d_tables((3, 9), 16, base=77.0)
    assert not cos.is_inference()
    m = timm.create_model("hvit3_tiny", img_size=64)
    with torch.inference_mode():
        m(torch.randn(1, 3, 64, 64))
    m(torch.randn(1, 3, 64, 64)).sum().backward()


def test_traced_tables_are_built_in_the_graph():
    def f(x):
        cos, sin = rope.rope_2d_tables((x.shape[1], x.shape[2]), x.shape[3])
        return rope.rope_2d(x, cos, sin)
    x = torch.randn(1, 4, 4, 16)
    traced = torch.jit.trace(f, x)
    assert "cos" in str(traced.graph)  # the build is part of the graph, not a cached constant
    torch.testing.assert_close(traced(x), f(x), atol=1e-6, rtol=0)


def test_no_new_state_dict_keys():
    m = timm.create_model("hvit3_tiny", img_size=64)
    keys = set(m.state_dict())
    m(torch.randn(1, 3, 64, 64))
    assert set(m.state_dict()) == keys and not any("rope" in k for k in keys)


def test_torch_path_block_builds_no_tables():
    """The cached tables leave no table op in a block's launches (arange, pow, cos, sin, cat of the angles)."""
    with use_backend("torch"):
        infer, train = block_launches(timm.create_model("hvit3_tiny", img_size=64))
    for op in ("arange", "pow", "cos", "sin", "reciprocal"):
        assert op not in infer.aten and op not in train.aten, (op, infer.aten, train.aten)
    assert "complex" not in infer.aten, infer.aten


@triton_test
@pytest.mark.parametrize("name", ["hvit3_tiny", "hvit3_tiny_v3"])
def test_triton_path_block_turns_rope_inside_the_kernels(name):
    """On the Triton path the fused kernels turn q, k (and dq, dk back): no aten RoPE op (the complex multiply, the
    -sin, the clone / copy of the inverse) in a block's inference or training step."""
    with use_backend("triton"):
        infer, train = block_launches(timm.create_model(name, img_size=64))
    for op in ("mul", "complex", "neg", "clone", "copy_"):
        assert op not in infer.aten and op not in train.aten, (op, dict(infer.aten), dict(train.aten))
    fused = ("_fwd_update", "_fwd_finalize", "_fwd_apply", "_bwd_apply", "_bwd_finalize", "_bwd_update")
    assert all(train.triton[k] == 1 for k in fused) and infer.triton["_fwd_apply"] == 1, (infer.triton, train.triton)
