"""`torchrun --nproc_per_node 2 -m ttt_zoo train` on CPU (gloo): the same result as one process at twice the batch."""
import csv
import os
import subprocess
import sys

import pytest
import torch

from _train_data import make_tiny_digits

from ttt_zoo.train import run_state as ckpt
from ttt_zoo.train.trainer import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# augmentation, mixup, label smoothing and dropout off: the runs differ only in how the batch is split
EXACT = ["--model", "vit3_tiny", "--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4",
         "--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0",
         "--val-split", "val", "--no-aug", "--smoothing", "0", "--seed", "3", "--epochs", "2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_tiny_digits(str(tmp_path_factory.mktemp("digits")), train_per_class=7, val_per_class=3)


def _torchrun_cmd():
    """The `torchrun` script of this interpreter's environment (what a user types); its module when the script is
    missing or was installed for another interpreter (a copied venv's shebang)."""
    script = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if os.path.isfile(script):
        with open(script) as f:
            shebang = f.readline()[2:].strip()
        if os.path.realpath(shebang) == os.path.realpath(sys.executable):
            return [script]
    return [sys.executable, "-m", "torch.distributed.run"]


def _torchrun(*args, nproc=2, ok=True):
    cmd = [*_torchrun_cmd(), "--standalone", "--nproc_per_node", str(nproc), "-m", "ttt_zoo", "train", *args]
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="default")  # the workers' warnings reach stderr (none filtered away)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert (out.returncode == 0) == ok, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def _rows(folder):
    return list(csv.DictReader(open(os.path.join(folder, "summary.csv"))))


def test_ddp_two_processes_equal_one_process(data, tmp_path):
    """2 processes x batch 16 == 1 process x batch 32 after 4 updates (70 images: 2 updates per epoch), weights
    within 1e-5 relative; the evaluation reduced over ranks gives the same accuracy and loss."""
    main(["--data-dir", data, "--output", str(tmp_path), "--experiment", "one", "-b", "32", *EXACT])
    out = _torchrun("--data-dir", data, "--output", str(tmp_path), "--experiment", "two", "-b", "16", *EXACT)
    one, two = (ckpt.load_state(ckpt.state_path(str(tmp_path / n), "last")) for n in ("one", "two"))
    assert one["num_updates"] == two["num_updates"] == 4 and two["world_size"] == 2
    assert len(two["rng"]) == 2  # both ranks' RNG states, for resume
    for k, a in one["model"].items():
        b = two["model"][k]
        assert (a - b).norm() <= 1e-5 * a.norm() + 1e-8, (k, float((a - b).norm() / a.norm()))
    import timm
    from timm.utils import random_seed
    random_seed(3, 0)  # the trainer's seeding: rank 0's initial weights, which DDP broadcasts
    init = timm.create_model("vit3_tiny", depth=1, embed_dim=16, num_heads=2, patch_size=4, img_size=16,
                             num_classes=10).state_dict()
    change = [float((one["model"][k] - init[k]).norm()) for k in init]
    assert max(change) > 1e-3  # training really moved the weights, so the comparison means something
    r1, r2 = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["eval_top1"] for r in r1] == [r["eval_top1"] for r in r2]
    for a, b in zip(r1, r2):
        assert float(a["eval_loss"]) == pytest.approx(float(b["eval_loss"]), rel=1e-5)
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-5)
    # only rank 0 wrote: one log, no stray files
    assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "one"))
    assert out.stderr.count("epoch 1: train_loss") == 1
    # DDP's gradient buckets match the gradients' layout (lay_out_as_gradients): no warning from any worker
    assert "train epoch 0 [1/" in out.stderr  # (the workers' stderr is here)
    assert "bucket view strides" not in out.stderr, out.stderr[-3000:]


def _stride_mismatches(model, x):
    """Parameters whose gradient's strides differ from the parameter's (what DDP's reducer compares exactly)."""
    model.zero_grad(set_to_none=True)
    model(x).float().sum().backward()
    return sorted(k for k, p in model.named_parameters() if p.grad is not None and p.grad.stride() != p.stride())


def test_conv_weights_laid_out_as_their_gradients():
    """The cause of DDP's "grad strides do not match bucket view strides": the blocks' convs read the channels-last
    view of the tokens and return their weights' gradients channels-last (depthwise (C, 1, k, k): strides
    (k*k, 1, k, 1) against the weight's (k*k, k*k, k, 1)); lay_out_as_gradients lays those weights out so, and
    leaves weights whose channels-last order differs (the patch embedding) alone; values and outputs unchanged."""
    import timm
    from ttt_zoo.train.distributed import lay_out_as_gradients
    torch.manual_seed(0)
    model = timm.create_model("vit3_tiny", depth=1, embed_dim=16, num_heads=2, patch_size=4, img_size=16,
                              num_classes=10)
    pointwise = torch.nn.Conv2d(8, 4, 1)  # (O, I, 1, 1): fed channels-last, its gradient comes channels-last too
    x, xp = torch.randn(2, 3, 16, 16), torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    assert _stride_mismatches(model, x) == ["blocks.0.cpe.weight"]
    # (the pointwise gradient's layout before the fix depends on the CPU conv backend: channels-last on some
    # machines, contiguous on others; after it, it matches on every one)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(x)
    patch = model.patch_embed.proj.weight.stride()
    assert lay_out_as_gradients(model) == 1 and lay_out_as_gradients(pointwise) == 1
    assert lay_out_as_gradients(model) == 0  # once is enough
    assert _stride_mismatches(model, x) == [] and _stride_mismatches(pointwise, xp) == []
    assert _stride_mismatches(pointwise, xp.contiguous()) == []  # whatever the input's layout
    assert model.patch_embed.proj.weight.stride() == patch  # (16, 3, 4, 4): channels-last is another order
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(x), out)


@pytest.mark.slow
def test_torchrun_cli_batchnorm_ema_accum_resume(data, tmp_path):
    """The CLI under torchrun with a BatchNorm model, --model-ema and --grad-accum-steps, stopped and resumed;
    --sync-bn on CPU is refused with a clear message (torch's SyncBatchNorm needs GPUs)."""
    args = ["--data-dir", data, "--output", str(tmp_path), "--model", "test_resnet", "--img-size", "16",
            "--workers", "0", "-b", "8", "--epochs", "2", "--warmup-epochs", "0", "--val-split", "val",
            "--model-ema", "--grad-accum-steps", "2", "--lr", "0.01"]
    _torchrun(*args, "--experiment", "bn", "--stop-after", "1")
    s = ckpt.load_state(ckpt.state_path(str(tmp_path / "bn"), "last"))
    assert s["epoch"] == 1 and s["num_updates"] == 2  # 70 images / (8 x 2 ranks) = 4 batches = 2 updates
    assert any(k.endswith("running_mean") for k in s["model"]) and s["ema"] is not None
    _torchrun(*args, "--resume", str(tmp_path / "bn"))
    s = ckpt.load_state(ckpt.state_path(str(tmp_path / "bn"), "last"))
    assert s["epoch"] == 2 and s["num_updates"] == 4
    assert [r["epoch"] for r in _rows(tmp_path / "bn")] == ["0", "1"]
    out = _torchrun(*args, "--experiment", "sync", "--sync-bn", ok=False)
    assert "--sync-bn needs GPUs" in out.stderr
