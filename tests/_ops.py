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
