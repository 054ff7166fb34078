"""Launches of one Vision-TTT block (issue 48): the block's glue (everything but the scan) and the torch path.

Counted by ``ttt_zoo.bench.launches`` at the dispatcher on the CPU (one block at 96 px, batch 2), as
``tests/test_launch_counts.py`` counts every family.  The glue is counted with the scan replaced by a stand-in that
launches nothing, forward and backward, so its ceilings hold whatever the scan kernels do; the torch path's
ceilings count the real scan.  Lower a ceiling when a count drops; never raise one without saying why.

Before (the glue of 17e7bd1, counted the same way): glue 22 / 62 (tiny, h_tiny), 23 / 64 (tiny_la) launches in
inference / a training step; tau was built per call (arange, reciprocal, mul, add, relu), two GEMMs in training.
"""
import functools

import pytest
import timm
import torch

import ttt_zoo  # noqa: F401
from ttt_zoo.bench.launches import block_launches, count_launches
from ttt_zoo.kernels.backend import use_backend
from ttt_zoo.layers import ttt_linear as layer

# the glue of one block (inference, training step), the scan not counted
GLUE_CEILINGS = {"visionttt_tiny": (19, 56), "visionttt_tiny_la": (19, 56), "visionttt_h_tiny": (19, 56)}
# the whole block on the torch path
TORCH_CEILINGS = {"visionttt_tiny": (75, 334), "visionttt_tiny_la": (67, 159), "visionttt_h_tiny": (75, 334)}


class _Stand(torch.autograd.Function):
    """Stands in for the scan: an output like q and gradients like the inputs (their shapes and strides: a scan that
    reads and writes the projection's layout), launching nothing."""

    @staticmethod
    def forward(ctx, q, k, v, lr, tau, w0, b0):
        ctx.inputs = (q, k, v, lr, tau, w0, b0)  # kept for their layouts only
        ctx.shared = k is q
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        grads = [torch.empty_like(t) if need else None for t, need in zip(ctx.inputs, ctx.needs_input_grad)]
        if ctx.shared:  # q = k: the real ops return the gradient once
            grads[1] = None
        return tuple(grads)


def _ttt_free(q, k, v, lr, tau, w0, b0, *rest):
    return _Stand.apply(q, k, v, lr, tau, w0, b0), None


def _la_free(q, k, v, lr, tau, w0, b0, *rest):
    return _Stand.apply(q, k, v, lr, tau, w0, b0)


@functools.lru_cache(maxsize=None)
def _counts(name, glue_only):
    torch.manual_seed(0)
    with use_backend("torch"), pytest.MonkeyPatch.context() as mp:
        if glue_only:
            mp.setattr(layer, "ttt_linear_bidir", _ttt_free)
            mp.setattr(layer, "linear_attention_bidir", _la_free)
        infer, train = block_launches(timm.create_model(name))
    return infer, train


@pytest.mark.parametrize("name", sorted(GLUE_CEILINGS))
def test_block_glue_launches(name):
    """The block without its scan: norms, residuals, SwiGLU, the conv, projections, lr gate, tau, post-norm gate."""
    infer, train = _counts(name, True)
    ceil_i, ceil_t = GLUE_CEILINGS[name]
    assert infer.total <= ceil_i, f"{name} glue, inference: {infer.total} > {ceil_i}: {dict(infer.aten)}"
    assert train.total <= ceil_t, f"{name} glue, training: {train.total} > {ceil_t}: {dict(train.aten)}"
    # tau is two launches (add, relu), no RoPE table or cast is built per call in the glue
    for op in ("arange", "reciprocal", "cos", "sin", "pow", "_to_copy"):
        assert op not in infer.aten and op not in train.aten, (op, dict(infer.aten), dict(train.aten))
    assert infer.aten["relu"] == 1 and infer.aten["mul"] == 3, dict(infer.aten)  # lr scale, SwiGLU, gate
    assert train.aten["addmm"] == 4, dict(train.aten)  # fc1, fc2, o_proj and ONE fused q/k/gate/v/lr GEMM


@pytest.mark.parametrize("name", sorted(TORCH_CEILINGS))
def test_block_torch_path_launches(name):
    infer, train = _counts(name, False)
    ceil_i, ceil_t = TORCH_CEILINGS[name]
    assert infer.triton_total == 0 and train.triton_total == 0
    assert infer.total <= ceil_i, f"{name} torch path, inference: {infer.total} > {ceil_i}: {dict(infer.aten)}"
    assert train.total <= ceil_t, f"{name} torch path, training: {train.total} > {ceil_t}: {dict(train.aten)}"


def test_stand_in_scan_launches_nothing():
    """The glue counts above are only the glue's if the stand-in itself is free, forward and backward."""
    q, v = torch.randn(2, 3, 36, 8, requires_grad=True), torch.randn(2, 3, 36, 8, requires_grad=True)
    lr = torch.rand(2, 3, 36, requires_grad=True)
    tau, w0, b0 = torch.rand(4, requires_grad=True), torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 1, 8)

    def step():
        out, _ = _ttt_free(q, q, v, lr, tau, w0, b0)
        out.backward(torch.empty_like(out))
    assert count_launches(step).total == 0
