"""``ttt-zoo train --task sd3``: data format, the rectified-flow step, evaluation, one tiny run of the trainer."""
import csv
import json
import os

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _images(root, n=4, txt=False):
    from PIL import Image
    os.makedirs(root, exist_ok=True)
    rows = []
    for i in range(n):
        Image.new("RGB", (40, 36), (60 * i, 100, 200 - 40 * i)).save(os.path.join(root, f"{i}.png"))
        cap = ["a red square", "a blue circle on white", "a green stripe", "a photo of a big square"][i % 4]
        if txt:
            open(os.path.join(root, f"{i}.txt"), "w").write(cap)
        rows.append({"file_name": f"{i}.png", "text": cap})
    if not txt:
        with open(os.path.join(root, "metadata.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    from ttt_zoo.sd3.tiny import tiny_sd3_pipeline
    d = tmp_path_factory.mktemp("sd3") / "pipe"
    tiny_sd3_pipeline().save_pretrained(d)
    return str(d)


def _task(argv):
    from ttt_zoo.train.args import parse_args
    from ttt_zoo.train.distributed import DistInfo
    args, cls = parse_args(["--task", "sd3"] + argv)
    return cls(args, DistInfo(0, 0, 1, torch.device("cpu"), True))


def test_captions_formats_and_errors(tmp_path):
    from ttt_zoo.train.sd3 import read_captions
    _images(tmp_path / "a")
    _images(tmp_path / "b", txt=True)
    assert [c for _, c in read_captions(str(tmp_path / "a"))] == [c for _, c in read_captions(str(tmp_path / "b"))]
    os.remove(tmp_path / "b" / "2.txt")
    with pytest.raises(ValueError, match="2.png has no caption"):
        read_captions(str(tmp_path / "b"))
    (tmp_path / "a" / "metadata.jsonl").write_text('{"file_name": "9.png", "text": "x"}\n')
    with pytest.raises(ValueError, match="not found"):
        read_captions(str(tmp_path / "a"))


def test_flow_matching_inputs_follow_the_scheduler():
    """x_t = (1 - s) x0 + s noise, target noise - x0, timesteps = 1000 s (the scheduler's shifted pairs)."""
    from argparse import Namespace
    from diffusers import FlowMatchEulerDiscreteScheduler
    from ttt_zoo.train.sd3 import flow_matching_inputs
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    x0 = torch.randn(64, 4, 2, 2)
    args = Namespace(weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, mode_scale=1.29)
    noisy, t, target, w = flow_matching_inputs(x0, sched, args, torch.Generator().manual_seed(0))
    s = (t / 1000.0).view(-1, 1, 1, 1)
    noise = target + x0
    torch.testing.assert_close(noisy, (1 - s) * x0 + s * noise)
    assert torch.equal(w, torch.ones_like(w)) and t.min() > 0 and t.max() <= 1000
    assert 0.6 < s.mean() < 0.9  # logit-normal u, shifted by 3 towards noise


def test_task_step_distill_and_eval(tmp_path, pipeline_dir):
    _images(tmp_path / "d")
    task = _task(["--sd3-pipeline", pipeline_dir, "--data-dir", str(tmp_path / "d"), "--img-size", "32", "-b", "2",
                  "-j", "0", "--max-sequence-length", "16", "--distill-weight", "0.5", "--cache-text-embeddings",
                  "--ttt-joint-layers", "4", "5", "--ttt-lr-scale", "2"])
    model = task.build_model()
    assert type(model).__name__ == "SD3T5Transformer2DModel" and model.config.ttt_joint_layers == [4, 5]
    groups = task.param_groups(model, 1e-4)
    assert sorted({g["lr_scale"] for g in groups}) == [1.0, 2.0]
    train, val = task.build_loaders()
    assert task.text_pipe is None and len(task._embeds) == 4  # cached, encoders freed
    batch = next(iter(train))
    loss, extras = task.train_step(model, batch)
    loss.backward()
    assert torch.isfinite(loss) and extras["distill"] > 0
    assert all(p.grad is not None for n, p in model.named_parameters() if ".ttt.w1" in n)
    m1 = task.evaluate(model.eval(), val)
    assert m1.keys() == {"loss", "mse_teacher"} and m1["mse_teacher"] > 0
    assert task.evaluate(model, val) == m1  # fixed noise / timesteps: repeatable
    assert task.evaluate(task.teacher, val)["mse_teacher"] == 0.0


def test_trainer_runs_sd3_task(tmp_path, pipeline_dir):
    from ttt_zoo.train.trainer import main
    _images(tmp_path / "d")
    assert main(["--task", "sd3", "--sd3-pipeline", pipeline_dir, "--data-dir", str(tmp_path / "d"), "--img-size",
                 "32", "-b", "2", "-j", "0", "--max-sequence-length", "16", "--opt", "adamw", "--lr", "1e-3",
                 "--sched", "step", "--decay-rate", "1.0", "--warmup-epochs", "0", "--epochs", "2", "--cache-latents",
                 "--grad-checkpointing", "--model-ema", "--model-ema-decay", "0.9", "--output", str(tmp_path / "o"),
                 "--experiment", "e", "--device", "cpu"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "o" / "e" / "summary.csv")))
    assert len(rows) == 2 and {"eval_loss", "eval_mse_teacher", "eval_ema_loss"} <= set(rows[0])
    from safetensors.torch import load_file
    sd = load_file(tmp_path / "o" / "e" / "last.safetensors")
    assert any(".ttt.w1" in k for k in sd)
