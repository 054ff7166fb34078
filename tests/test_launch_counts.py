"""What a step launches, counted (issue 39): the counter itself, the fused ViT3 op (at most 3 Triton launches
forward and 3 backward), the ViT3 block against timm's DeiT block on the Triton path, and every classifier code
path's block against its ceiling, on both paths.  Counts, not times: they do not depend on the machine.

Ceilings (``CEILINGS``) are the counts of experiments/results/launch_counts.md; a model missing from the table fails,
so a new family or variant cannot slip past.  Lower a ceiling when a count drops; never raise one without saying why.
"""
import functools
import os

import pytest
import timm
import torch
import torch.nn.functional as F

import ttt_zoo  # noqa: F401
from ttt_zoo.bench.launches import block_launches, code_paths, count_launches
from ttt_zoo.kernels.backend import BackendError, use_backend

PEER = "deit_tiny_patch16_224"

# the torch path of the ViT3 block before issue 39 (24ddb19): 48 launches in inference, 201 in a training step
VIT3_TORCH_BEFORE = (48, 201)


@functools.lru_cache(maxsize=None)
def _block(name, backend):
    torch.manual_seed(0)
    with use_backend(backend):
        model = timm.create_model(name, **({"img_size": 96} if name == PEER else {}))
        return block_launches(model)


@pytest.fixture(scope="module")
def deit():
    return _block(PEER, "torch")


def test_counter_counts_kernels_not_views():
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)

    def fn():
        y = F.linear(x, w, b)            # one addmm (linear's t() is a view)
        y = y.view(2, 2, 16).transpose(0, 1).reshape(4, 16)  # a copy: the reshape of a non-contiguous view
        torch.empty(3)                   # allocation: no launch
        return torch.relu(y)             # one relu

    c = count_launches(fn)
    assert dict(c.aten) == {"addmm": 1, "clone": 1, "relu": 1}, c.aten
    assert c.triton_total == 0


@pytest.mark.triton
def test_counter_counts_triton_launches_once():
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    import triton.language as tl

    @triton.jit
    def _double(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs, mask=offs < N) * 2, mask=offs < N)

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    x = torch.randn(100, device=device)
    y = torch.empty_like(x)
    c = count_launches(lambda: _double[(4,)](x, y, 100, BLOCK=32))
    assert dict(c.triton) == {"_double": 1}
    assert c.aten_total == 0, c.aten  # the interpreter's own tensor work is not a launch
    torch.testing.assert_close(y, 2 * x)


@pytest.mark.triton
def test_vit3_block_triton_path(deit):
    """The ViT3-T block on the Triton path, counted once (the interpreter takes minutes per block): the fused op at
    3 Triton launches forward and 3 backward with no aten glue inside, the block within 1.5x / 1.3x of timm's DeiT-T
    block, and within its ceiling."""
    infer, train = _block("vit3_tiny", "triton")
    assert infer.by_op == {"vit3_qkv_fwd": 3}, infer.by_op
    assert train.by_op == {"vit3_qkv_fwd": 3, "vit3_qkv_bwd": 3}, train.by_op
    assert infer.triton_total == 3 and train.triton_total == 6  # Triton kernels only: no aten glue inside the op
    peer_infer, peer_train = deit
    assert infer.total <= 1.5 * peer_infer.total, (infer.total, peer_infer.total, infer.aten)
    assert train.total <= 1.3 * peer_train.total, (train.total, peer_train.total, train.aten)
    _assert_within_ceiling("vit3_tiny", "triton", infer, train)


def test_vit3_block_torch_path_diet():
    infer, train = _block("vit3_tiny", "torch")
    assert infer.total <= 0.7 * VIT3_TORCH_BEFORE[0], infer.aten
    assert train.total <= 0.7 * VIT3_TORCH_BEFORE[1], train.aten


# Ceilings per block (inference, training), from experiments/results/launch_counts.md: the torch path of every
# classifier code path, and the Triton path of one model per custom op (the fused ViT3 op, a variant op,
# TTT-Linear, linear attention; the interpreter is slow: H-ViT3-T's block took 209 s).  None: the path cannot run
# the model's ops (T5-T's head dim 64 is above its kernel's limit of 32).
CEILINGS = {
    ("hvit3_tiny", "torch"): (52, 164),
    ("hvit3_tiny_v1", "torch"): (64, 201),
    ("hvit3_tiny_v3", "torch"): (54, 156),
    ("hvit3_tiny_v6", "torch"): (48, 122),
    ("t5_plus_tiny", "torch"): (111, 377),
    ("t5_tiny", "torch"): (58, 247),
    ("t5_tiny", "triton"): None,
    ("visionttt_h_tiny", "torch"): (253, 3102),
    ("visionttt_h_tiny_la", "torch"): (71, 172),
    ("visionttt_tiny", "torch"): (103, 570),
    ("visionttt_tiny", "triton"): (66, 139),
    ("visionttt_tiny_la", "torch"): (71, 173),
    ("visionttt_tiny_la", "triton"): (53, 177),
    ("vit3_tiny", "torch"): (33, 129),
    ("vit3_tiny", "triton"): (14, 40),
    ("vit3_tiny_v1", "torch"): (45, 166),
    ("vit3_tiny_v3", "torch"): (35, 121),
    ("vit3_tiny_v3", "triton"): (32, 110),
    ("vit3_tiny_v6", "torch"): (29, 87),
}


def test_every_code_path_has_a_ceiling():
    missing = sorted({(m, "torch") for m in code_paths()} - set(CEILINGS))
    assert not missing, f"no launch ceiling for {missing}: run experiments/launch_counts.py and add its rows"


def _assert_within_ceiling(name, path, infer, train):
    ceiling = CEILINGS[name, path]
    assert infer.total <= ceiling[0] and train.total <= ceiling[1], \
        f"{name} on the {path} path launches {infer.total} / {train.total} per block, above {ceiling}"


@pytest.mark.parametrize("name,path", sorted(set(CEILINGS) - {("vit3_tiny", "triton")}))  # that one: above
def test_block_launches_within_ceiling(name, path):
    if CEILINGS[name, path] is None:
        with pytest.raises(BackendError):
            _block(name, path)
        return
    _assert_within_ceiling(name, path, *_block(name, path))
