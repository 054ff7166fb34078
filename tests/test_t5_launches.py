"""Launches of the T5, T5+ and DiT5 blocks (issue 48): the glue around the inner step is a few launches.

Counted on the CPU at the dispatcher by ``ttt_zoo.bench.launches`` (views and allocations are not launches).  Before
(299558e), torch path, inference / training step: T5-T block 58 / 247, T5+-T 111 / 377, DiT5-S/2 block 118 / 289.
"""
import pytest
import timm
import torch

import ttt_zoo  # noqa: F401  (registers the models)
from ttt_zoo.bench.launches import block_launches, count_launches
from ttt_zoo.kernels.backend import use_backend
from ttt_zoo.layers import T5TTT

#: torch path (inner step in PyTorch): (inference, training) ceilings reached by the glue of this change
TORCH_CEILINGS = {"t5_tiny": (57, 243), "t5_plus_tiny": (58, 251)}
DIT5_TORCH_CEILING = (58, 198)
#: Triton path: launches outside the inner step's own (its Triton kernels and the aten ops inside the custom op);
#: the training count includes what autograd launches for the op's unused outputs (zero gradients)
TRITON_GLUE_CEILINGS = {"t5_tiny": (13, 43), "t5_plus_tiny": (15, 51), "dit5": (26, 90)}
INNER_OPS = ("t5_swiglu_fwd", "t5_swiglu_bwd", "dit5_mlp_fwd", "dit5_mlp_bwd")


def _module_launches(module, *args):
    """(inference, training) counts of ``module(*args)``, as ``block_launches`` counts a block."""
    run = lambda: module(*args)  # noqa: E731
    module.eval()
    with torch.no_grad():
        run()
        infer = count_launches(run)
    module.train()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for t in tensors:
        t.requires_grad_(True)

    def step():
        module.zero_grad(set_to_none=True)
        for t in tensors:
            t.grad = None
        run().sum().backward()

    step()
    return infer, count_launches(step)


def _dit5_block(hidden=384, heads=6, side=16):
    torch.manual_seed(0)
    model = timm.create_model("dit5_s_2", hidden_size=hidden, num_heads=heads, depth=1)
    b, c = 2, model.blocks[0].attn.dim
    return _module_launches(model.blocks[0], torch.randn(b, side * side, c), torch.randn(b, c), (side, side))


@pytest.mark.parametrize("name", sorted(TORCH_CEILINGS))
def test_t5_block_launches_torch_path(name):
    torch.manual_seed(0)
    with use_backend("torch"):
        infer, train = block_launches(timm.create_model(name, depth=1), img_size=96)
    ceil_infer, ceil_train = TORCH_CEILINGS[name]
    assert infer.total <= ceil_infer, infer.table()
    assert train.total <= ceil_train, train.table()
    # no copies around the op: the convs read strided views of the qkv output, the heads merge as views
    assert infer.aten["convolution"] == 2 and infer.aten["_foreach_add"] == 1 and infer.aten["add"] <= 4
    if name == "t5_plus_tiny":  # neighbourhood attention as one masked SDPA at 6 x 6 tokens, averaged by one lerp
        assert infer.aten["_scaled_dot_product_flash_attention_for_cpu"] == 1 and infer.aten["lerp"] == 1


def test_dit5_block_launches_torch_path():
    with use_backend("torch"):
        infer, train = _dit5_block()
    assert infer.total <= DIT5_TORCH_CEILING[0], infer.table()
    assert train.total <= DIT5_TORCH_CEILING[1], train.table()
    assert infer.aten["_scaled_dot_product_flash_attention_for_cpu"] == 1 and infer.aten["addcmul"] == 1


def test_t5_recompute_default_follows_the_inner_step():
    """``recompute=None`` recomputes around the PyTorch inner step (memory) but not around the Triton one
    (launches); an explicit True / False is kept."""
    m = T5TTT(64, num_heads=2)
    x = torch.randn(1, 4, 64)
    with use_backend("torch"):
        assert m._recomputes(x)
    m.recompute = False
    assert not m._recomputes(x)
    m.recompute = True
    assert m._recomputes(x)


def _glue(counts):
    return counts.total - sum(counts.by_op[op] for op in INNER_OPS)


def _triton_or_skip():
    pytest.importorskip("triton")


@pytest.mark.triton
@pytest.mark.parametrize("name,img", [("t5_tiny", 32), ("t5_plus_tiny", 80)])
def test_t5_block_glue_triton_path(name, img):
    """Head dim 32 (6 heads at 192 channels): the inner step on Triton, the glue around it counted."""
    _triton_or_skip()
    torch.manual_seed(0)
    with use_backend("triton"):
        infer, train = block_launches(timm.create_model(name, depth=1, num_heads=6), img_size=img)
    assert infer.by_op["t5_swiglu_fwd"] > 0 and train.by_op["t5_swiglu_bwd"] > 0  # Triton ran the inner step
    assert infer.triton["_knorm_fwd"] == 1 and "mean" not in infer.aten  # the key norm: one kernel
    ceil_infer, ceil_train = TRITON_GLUE_CEILINGS[name]
    assert _glue(infer) <= ceil_infer, infer.table()
    assert _glue(train) <= ceil_train, train.table()


@pytest.mark.triton
def test_dit5_block_glue_triton_path():
    _triton_or_skip()
    with use_backend("triton"):
        infer, train = _dit5_block(hidden=128, heads=4, side=4)  # head dim 32, 16 tokens
    assert infer.by_op["dit5_mlp_fwd"] > 0 and train.by_op["dit5_mlp_bwd"] > 0
    ceil_infer, ceil_train = TRITON_GLUE_CEILINGS["dit5"]
    assert _glue(infer) <= ceil_infer, infer.table()
    assert _glue(train) <= ceil_train, train.table()
