"""Shared by the per-op test files (tests/test_op_<op>.py): where the Triton kernels can run, and how to mark them."""
import importlib

import pytest
import torch

from ttt_zoo.kernels.backend import HAS_TRITON, triton_unsupported

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton installed, and a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it before triton is first imported)
TRITON_OK = triton_unsupported(torch.device(DEV)) is None
# every backend that can run here; forcing 'triton' where it cannot raises (tests/test_op_backend.py)
BACKENDS = ["torch", "torch_naive"] + (["triton"] if TRITON_OK else [])
# the meta device takes the custom ops (fake kernels) whenever Triton is installed
META_BACKENDS = ["torch", "torch_naive"] + (["triton"] if HAS_TRITON else [])


def triton_test(f):
    """A test of the kernels themselves: marked ``triton`` and skipped where they cannot run."""
    return pytest.mark.triton(pytest.mark.skipif(not TRITON_OK, reason="the Triton kernels cannot run here")(f))


def triton_kernels(op: str):
    """``ttt_zoo.kernels.<op>.triton``, or None where the kernels cannot run."""
    return importlib.import_module(f"ttt_zoo.kernels.{op}.triton") if TRITON_OK else None


def compare_kernel(f_new, f_ref, inputs, dtype, names, tol):
    """Forward and every gradient of ``f_new`` in ``dtype`` against ``f_ref`` run in float32 on float32 copies of the
    same (rounded) data; gradients compared relative to their magnitude.  ``tol``: dtype -> assert_close kwargs."""
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    out = f_new(*leaves)
    ref = f_ref(*ref_leaves)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **tol[dtype])
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, do.to(dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    for name, g, r in zip(names, grads, ref_grads):
        assert g.dtype == dtype and g.shape == r.shape, name
        scale = r.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(g.float() / scale, r / scale, **tol[dtype], msg=lambda m: f"d{name}: {m}")
