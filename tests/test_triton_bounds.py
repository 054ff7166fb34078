import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from triton_bounds import TritonOutOfBounds  # noqa: E402

# the kernel stage of `make test` runs the `triton` tests with the interpreter on
pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter's bounds checker")]


@triton.jit
def _copy(x_ptr, y_ptr, n, shift, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs + shift, mask=offs < n), mask=offs < n)


def test_in_bounds_kernel_runs():
    x = torch.arange(8.0)
    y = torch.zeros(8)
    _copy[(1,)](x, y, 8, 0, BLOCK=8)
    torch.testing.assert_close(y, x)


def test_out_of_bounds_load_raises():
    # the load is shifted by one element past the end of x: the last lane reads outside every argument
    x, y = torch.arange(8.0), torch.zeros(8)
    with pytest.raises(Exception) as err:
        _copy[(1,)](x[:8], y, 8, 1 << 20, BLOCK=8)
    assert "outside every tensor argument" in str(err.value) or isinstance(err.value.__cause__, TritonOutOfBounds)
