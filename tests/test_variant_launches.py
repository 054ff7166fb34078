"""Launches of the ViT3 / H-ViT3 inner-loop variants' blocks (issue 48, deliver 3): on the Triton path the variant
mixer core is the fused core of ``kernels/vit3_variant/fused.py`` (3 Triton launches forward, 3 backward, nothing
else inside), so a ViT3 variant's block is within 1.5x DeiT-T's launches in inference and 1.3x in a training step,
and no variant's block launches more than its baseline's.  Counted at the dispatcher (``ttt_zoo.bench.launches``),
the kernels run in the interpreter without a GPU; counts do not depend on the machine.
"""
import functools

import pytest
import timm
import torch

import ttt_zoo  # noqa: F401
from _ops import triton_test
from ttt_zoo.bench.launches import block_launches
from ttt_zoo.kernels.backend import use_backend

INFER_X, TRAIN_X = 1.5, 1.3  # issue 48: a block's launches against DeiT-T's
FUSED_FWD = {"_fwd_update": 1, "_fwd_finalize": 1, "_fwd_apply": 1}
FUSED_BWD = {"_bwd_apply": 1, "_bwd_finalize": 1, "_bwd_update": 1}
VIT3_VARIANTS = ["vit3_tiny_v1", "vit3_tiny_v3", "vit3_tiny_v6"]
# Table 1's options on top of a Table 2 variant: gradient ascent with queries replaced by keys, and k = 3 steps
OPTIONS = {"ascent_qk": dict(gradient_ascent=True, share_qk=True), "steps3": dict(inner_steps=3)}


@functools.lru_cache(maxsize=None)
def _launches(name, backend, img_size=64, **mixer_kwargs):
    torch.manual_seed(0)
    with use_backend(backend):
        kw = dict(mixer_kwargs=mixer_kwargs) if mixer_kwargs else {}
        model = timm.create_model(name, img_size=img_size, **kw)
        return block_launches(model, img_size=img_size)


@pytest.fixture(scope="module")
def deit():
    return _launches("deit_tiny_patch16_224", "torch", img_size=32)


# the block's CPE (and H-ViT3's MLP conv), and the MLP's GELU recomputed with its gradient (kernels/mlp_gelu)
GLUE_OPS = ("residual_dwconv3x3_fwd", "residual_dwconv3x3_bwd", "mlp_gelu_vjp")


def _assert_fused(infer, train):
    """The variant core runs the fused kernels, 3 + 3; every other Triton launch is the block's glue: the residual
    conv and the MLP's GELU vjp."""
    for counts, want in ((infer, FUSED_FWD), (train, {**FUSED_FWD, **FUSED_BWD})):
        core = {k: n for k, n in counts.triton.items() if k in want}
        assert core == want, counts.triton
        conv = sum(counts.by_op[op] for op in GLUE_OPS)
        assert counts.triton_total - sum(core.values()) == conv, (counts.triton, counts.by_op)


@triton_test
@pytest.mark.parametrize("name", VIT3_VARIANTS)
def test_vit3_variant_block_within_deit(name, deit):
    infer, train = _launches(name, "triton")
    _assert_fused(infer, train)
    assert infer.total <= INFER_X * deit[0].total and train.total <= TRAIN_X * deit[1].total, \
        f"{name}: {infer.total} / {train.total} launches, DeiT-T {deit[0].total} / {deit[1].total}"


@triton_test
@pytest.mark.parametrize("option", list(OPTIONS))
def test_table1_options_take_the_fused_core(option, deit):
    """Ascent and Q := K (a 2C + 2d projection; dq joins dk inside the kernels) and k steps cost no launch."""
    infer, train = _launches("vit3_tiny_v1", "triton", **OPTIONS[option])
    _assert_fused(infer, train)
    base_infer, base_train = _launches("vit3_tiny_v1", "triton")
    assert infer.total <= base_infer.total and train.total <= base_train.total


@triton_test
@pytest.mark.parametrize("name", ["hvit3_tiny_v1", "hvit3_tiny_v3", "hvit3_tiny_v6"])
def test_hvit3_variant_block_no_more_than_its_baseline(name):
    """H-ViT3's RoPE runs inside the fused kernels on both paths: the variant adds no launch to the baseline's block."""
    infer, train = _launches(name, "triton")
    _assert_fused(infer, train)
    base_infer, base_train = _launches("hvit3_tiny", "triton")
    assert infer.total <= base_infer.total and train.total <= base_train.total, \
        f"{name}: {infer.total} / {train.total}, hvit3_tiny {base_infer.total} / {base_train.total}"
