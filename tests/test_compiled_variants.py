"""One compiled variant per kernel, dtype and head dim, whatever the input size (issue 48), for every code path.

Triton compiles a kernel again for every new key of its cache: an integer argument that is 1, or divisible by 16,
on one input size and not on another, is specialised unless it is in ``do_not_specialize``.  Each code path runs on
the meta device at three image sizes whose token counts differ in divisibility and in the number of chunks (224 px:
14 x 14 patches; 256 px: 16 x 16; 384 px: 24 x 24) and at batch 1 and 8, and every Triton launch records its compile key; each call site (the n-th call of a kernel
in a step) must get one key over the sizes (``ttt_zoo.bench.compiled_variants``,
no GPU).  experiments/compiled_variants_registry.py runs the same count over the whole registry at the five
standard sizes and three batches.
"""
import pytest
import torch

import ttt_zoo  # noqa: F401
from ttt_zoo.bench import compiled_variants as cv
from ttt_zoo.bench.launches import code_paths

pytestmark = pytest.mark.skipif(bool(cv.available()), reason=cv.available() or "-")

# token counts 196 / 256 / 576 (divisible by 16 or not; one tile of 256 tokens or more: a kernel's single-chunk
# path), batch 1 and 8 (batch x heads divisible by 16 or not, and == 1)
SIZES, BATCHES = (224, 256, 384), (1, 8)


@pytest.mark.parametrize("name", code_paths(include_diffusion=True))
def test_one_compiled_variant_per_kernel_dtype_and_head_dim(name):
    calls, dims = cv.compile_keys(name, sizes=SIZES, batches=BATCHES, dtypes=(torch.float32, torch.bfloat16))
    assert calls, f"{name} launched no Triton kernel on the Triton backend"
    counts = cv.variants_per_kernel(calls, dims)
    assert {k[1] for k in counts} == {"float32", "bfloat16"}
    over = {f"{k[0]} {k[1]}": n for k, n in counts.items() if n != 1}
    assert not over, f"kernels compiled again for another input size (keys per call site): {over}"


def test_the_recorder_sees_a_specialised_argument(monkeypatch):
    """The count can fail: with ``do_not_specialize`` emptied, a kernel whose sizes vary gets one variant per
    divisibility class of its token count."""
    from ttt_zoo.kernels.vit3_ttt import fused

    for param in fused._fwd_update.params:  # the binder is built from these flags (triton.runtime.jit.KernelParam)
        monkeypatch.setattr(param, "do_not_specialize", False)
        monkeypatch.setattr(param, "do_not_specialize_on_alignment", False)
    counts = cv.variants_per_kernel(cv.compile_keys("vit3_tiny", sizes=(224, 256), batches=(1, 2),
                                                    dtypes=(torch.float32,))[0])
    assert counts[("vit3_ttt._fwd_update", "float32", "-")] > 1
