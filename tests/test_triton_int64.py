"""Every Triton kernel computes its base offsets in int64 (issue 48): a (B, N, C) activation passes 2^31 elements
from about batch 30 at 2048 px, where an int32 ``program x stride`` wraps to a wrong address.

(a) runs the shared offset helpers (``triton_utils.pid64`` / ``base_offset``) past 2^31 in the interpreter, without
allocating anything that large, against Python ints (and shows that the plain int32 product wraps there);
(b) reads every kernel file's source: each ``tl.program_id(...)`` is converted to int64 where it is read
(``tl.program_id(a).to(tl.int64)``) or taken through ``pid64``, so every offset built from it is 64-bit.
"""
import ast
import os
from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
KERNEL_FILES = sorted(p for p in KERNELS.glob("*/*.py") if p.name in ("triton.py", "fused.py"))


def _unconverted_program_ids(source: str):
    """Line numbers of ``tl.program_id(...)`` calls not immediately followed by ``.to(tl.int64)``."""
    tree = ast.parse(source)
    converted = set()
    for node in ast.walk(tree):  # tl.program_id(a).to(tl.int64)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to" \
                and node.args and ast.unparse(node.args[0]) in ("tl.int64", "triton.language.int64"):
            converted.add(id(node.func.value))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "program_id"
            and id(node) not in converted]


def test_static_check_finds_an_int32_program_id():
    src = "def k(X, s):\n    pid = tl.program_id(0)\n    q = tl.program_id(1).to(tl.int64)\n    return X + pid * s\n"
    assert _unconverted_program_ids(src) == [2]


def test_every_kernel_file_is_checked():
    assert {p.parent.name for p in KERNEL_FILES} >= {"vit3_ttt", "linear_attention", "inner_mlp", "key_norm",
                                                     "ttt_linear", "vit3_variant"}


@pytest.mark.parametrize("path", KERNEL_FILES + [KERNELS / "triton_utils.py"],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_program_ids_are_int64(path):
    lines = _unconverted_program_ids(path.read_text())
    assert not lines, (f"{path.relative_to(KERNELS.parent)}: tl.program_id at line(s) {lines} is int32; write "
                       "triton_utils.pid64(axis) or tl.program_id(axis).to(tl.int64) so the offsets built from it "
                       "are 64-bit")


# ------------------------------------------------------------------------------ (a) the helpers past 2^31
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ttt_zoo.kernels.triton_utils import base_offset, pid64  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the interpreter")


@triton.jit
def _offset_probe(OUT, first, stride, INT64: tl.constexpr):
    """OUT[p] = (first + program p) x stride, through the helpers (INT64) or as plain int32 arithmetic."""
    if INT64:
        off = base_offset(pid64(0) + first, stride)
    else:
        off = (tl.program_id(0) + first) * stride  # the int32 product this file forbids
    tl.store(OUT + tl.program_id(0).to(tl.int64), off.to(tl.int64))


@pytest.mark.triton
@interpreted
@pytest.mark.parametrize("first, stride", [(52, (16384 * 2484) // 1), (1, 2 ** 31 - 1), (65535, 65537)],
                         ids=["vit3b_2048px_batch53", "stride_2^31-1", "near_2^32"])
def test_base_offset_past_2_31(first, stride):
    """ViT3-B at 2048 px: N = 16384 tokens of 3C + 3d = 2484 projection columns; batch 53 starts past 2^31."""
    out = torch.zeros(2, dtype=torch.int64)
    _offset_probe[(2,)](out, first, stride, INT64=True)
    want = [(first + p) * stride for p in range(2)]
    assert max(want) >= 2 ** 31 and out.tolist() == want
    _offset_probe[(2,)](out, first, stride, INT64=False)
    assert out.tolist() != want  # the int32 product wraps: what the helpers prevent
