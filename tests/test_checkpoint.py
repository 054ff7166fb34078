"""ttt_zoo.checkpoint: every layout read safely, and the loading probes of issue 12 (offline, not a checkpoint,
wrong classifier) each answered with one clear message.  No network: the hub is offline (tests/conftest.py)."""
import argparse
import os
import socket

import pytest
import timm
import torch
from safetensors.torch import save_file

import ttt_zoo
from ttt_zoo import hub
from ttt_zoo.checkpoint import (CheckpointError, load_checkpoint_file, mmengine_backbone, unwrap_checkpoint,
                                validate_state_dict)

TINY = dict(depth=1)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Offline, with empty Hugging Face and torch.hub caches; any socket connect or URL download fails the test."""
    from huggingface_hub import constants
    assert constants.HF_HUB_OFFLINE, "tests must run with HF_HUB_OFFLINE=1"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    torch.hub.set_dir(str(tmp_path / "torch_hub"))

    def refuse(*args, **kwargs):
        raise AssertionError("went to the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    yield dict(hf=str(tmp_path / "hf"), torch_hub=str(tmp_path / "torch_hub"))


def test_pretrained_offline_says_what_where_and_how(offline):
    with pytest.raises(CheckpointError) as err:
        timm.create_model("vit3_tiny", pretrained=True)
    msg = str(err.value)
    cached = os.path.join(offline["torch_hub"], "checkpoints", "ttt_zoo", "vit3_tiny.in1k.pth")
    url = timm.models.get_pretrained_cfg("vit3_tiny.in1k").url
    for part in ("HF_HUB_OFFLINE=1", "'ttt-zoo/vit3_tiny.in1k'", offline["hf"], cached, url,
                 "pretrained_cfg_overlay=dict(file=", "local-dir:"):
        assert part in msg, (part, msg)


def test_hf_hub_with_empty_offline_cache_names_the_repo(offline):
    for load in (lambda: ttt_zoo.create_model("hf-hub:someone/vit3-nothing", pretrained=True),
                 lambda: hub.load_folder("hf-hub:someone/vit3-nothing")):
        with pytest.raises(CheckpointError) as err:
            load()
        msg = str(err.value)
        for part in ("'someone/vit3-nothing'", "offline mode is on (HF_HUB_OFFLINE=1)", offline["hf"], "local-dir:",
                     "pretrained_cfg_overlay=dict(file="):
            assert part in msg, (part, msg)


@pytest.mark.parametrize("first", [b"", b"\x80", b"PK\x03\x04"])
def test_random_bytes_are_not_a_checkpoint(tmp_path, first):
    """Random bytes, also behind a pickle or zip magic: a clear error, never torch's weights_only=False advice."""
    path = tmp_path / "weights.pth"
    path.write_bytes(first + torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1),
                                           dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(CheckpointError) as err:
        timm.create_model("vit3_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    msg = str(err.value)
    assert "weights_only" not in msg and "Re-running" not in msg
    assert ("is not a PyTorch checkpoint" if not first else "truncated or corrupt") in msg


def test_ten_class_head_into_thousand_class_model(tmp_path):
    src = timm.create_model("vit3_tiny", num_classes=10, **TINY)
    path = tmp_path / "c10.pth"
    torch.save({"model": src.state_dict()}, path)
    with pytest.raises(CheckpointError) as err:
        timm.create_model("vit3_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    msg = str(err.value)
    assert "head.weight: checkpoint (10, 192) vs model (1000, 192)" in msg
    assert "head.bias: checkpoint (10,) vs model (1000,)" in msg
    assert "num_classes=10" in msg and "another model size" not in msg
    # the suggested fix works and loads every tensor
    model = timm.create_model("vit3_tiny", pretrained=True, num_classes=10,
                              pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    for k, v in src.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)


class _FakeCfgNode(dict):
    """Pickled under yacs' name, as official ViT3 checkpoints carry their training config."""


_FakeCfgNode.__module__, _FakeCfgNode.__qualname__ = "yacs.config", "CfgNode"


def _save_as_yacs(obj, path):
    import sys
    import types
    mod = types.ModuleType("yacs.config")
    mod.CfgNode = _FakeCfgNode
    sys.modules["yacs"], sys.modules["yacs.config"] = types.ModuleType("yacs"), mod
    try:
        torch.save(obj, path)
    finally:
        del sys.modules["yacs"], sys.modules["yacs.config"]


def test_every_layout_unwraps_to_the_same_tensors(tmp_path):
    net = timm.create_model("vit3_tiny", **TINY)
    sd = net.state_dict()
    other = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    layouts = {
        "official.pth": ({"model": sd, "config": _FakeCfgNode(MODEL=_FakeCfgNode(TYPE="vittt")), "epoch": 3}, sd),
        "ema.pth": ({"model": other, "state_dict_ema": sd}, sd),
        "model_ema.pth": ({"model": other, "model_ema": sd}, sd),
        "dit.pth": ({"model": other, "ema": sd, "args": argparse.Namespace(model="DiT-B/2")}, sd),
        "mmengine.pth": ({"meta": {"iter": 1}, "state_dict": sd}, sd),
        "ddp.pth": ({"model": {"module." + k: v for k, v in sd.items()}}, sd),
        "bare.pth": (sd, sd),
    }
    for name, (obj, want) in layouts.items():
        path = str(tmp_path / name)
        (_save_as_yacs if "config" in obj else torch.save)(obj, path)
        got = unwrap_checkpoint(load_checkpoint_file(path))
        assert got.keys() == want.keys(), name
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert load_checkpoint_file(str(tmp_path / "official.pth"))["config"]["MODEL"]["TYPE"] == "vittt"
    assert isinstance(load_checkpoint_file(str(tmp_path / "dit.pth"))["args"], argparse.Namespace)
    # prefer_ema=False takes the raw weights when both are present
    raw = unwrap_checkpoint(load_checkpoint_file(str(tmp_path / "ema.pth")), prefer_ema=False)
    torch.testing.assert_close(raw["head.weight"], other["head.weight"], rtol=0, atol=0)
    # ours: safetensors
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    got = unwrap_checkpoint(load_checkpoint_file(str(tmp_path / "model.safetensors")))
    assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_mmengine_backbone_and_validation():
    net = timm.create_model("vit3_tiny", **TINY)
    sd = net.state_dict()
    ckpt = {"meta": {}, "state_dict": {**{"backbone." + k: v for k, v in sd.items()}, "decode_head.w": torch.ones(1)}}
    assert mmengine_backbone(ckpt).keys() == sd.keys()
    assert mmengine_backbone({"model": sd}) is None
    validate_state_dict(sd, net)
    with pytest.raises(CheckpointError, match=r"1 missing keys: \['blocks.0.norm1.weight'\]"):
        validate_state_dict({k: v for k, v in sd.items() if k != "blocks.0.norm1.weight"}, net)


def test_not_a_dict_and_missing_file(tmp_path):
    path = tmp_path / "list.pth"
    torch.save([torch.ones(2)], path)
    with pytest.raises(CheckpointError, match="holds a list, not a dict of tensors"):
        load_checkpoint_file(str(path))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint_file(str(tmp_path / "nope.pth"))


# ----- mmengine: load_from / resume go through ttt_zoo.adapters._mm's weights-only loader (mmengine alone) -----

class _MakeMarker:
    """Unpickling this creates the folder ``path``: proof that code from the file ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


class _Getattr:
    def __reduce__(self):
        from mmengine.logging import HistoryBuffer
        return (getattr, (HistoryBuffer, "__reduce_ex__"))


def _runner(tmp_path, load_from):
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, inputs=None, data_samples=None, mode="tensor"):
            return self.fc(inputs)
    return Runner(model=Net(), work_dir=str(tmp_path / "work"), load_from=str(load_from),
                  default_hooks=dict(logger=None), log_level="ERROR")


def test_mmengine_load_from_refuses_a_malicious_pickle(tmp_path, monkeypatch):
    pytest.importorskip("mmengine")
    import numpy as np
    from mmengine.logging import HistoryBuffer
    from mmengine.runner.checkpoint import load_checkpoint
    from ttt_zoo.adapters import _mm
    _mm.install_safe_loader()  # what importing ttt_zoo.adapters.mmdet / .mmseg does
    net = torch.nn.Linear(2, 2)
    state = {"fc." + k: v for k, v in net.state_dict().items()}

    ok = tmp_path / "ok.pth"  # what mmengine itself writes: meta, numpy, HistoryBuffer
    buf = HistoryBuffer()
    buf.update(1.5)
    torch.save({"meta": {"epoch": 1}, "state_dict": state, "message_hub": {"log_scalars": {"loss": buf}},
                "np": np.float64(2.0), "arr": np.zeros(3)}, ok)
    runner = _runner(tmp_path, ok)
    runner.load_or_resume()
    torch.testing.assert_close(runner.model.fc.weight, net.weight, rtol=0, atol=0)

    marker = str(tmp_path / "pwned")
    bad = tmp_path / "bad.pth"
    torch.save({"state_dict": state, "x": _MakeMarker(marker)}, bad)
    with pytest.raises(RuntimeError, match=r"Refusing to unpickle .*bad.pth.*GLOBAL posix.mkdir.*--trust-checkpoint"):
        _runner(tmp_path, bad).load_or_resume()
    assert not os.path.exists(marker)
    with pytest.raises(RuntimeError, match="--trust-checkpoint"):
        load_checkpoint(torch.nn.Linear(2, 2), str(bad))
    assert not os.path.exists(marker)
    sneaky = tmp_path / "sneaky.pth"  # getattr is allowed only for HistoryBuffer's public methods
    torch.save({"state_dict": state, "x": _Getattr()}, sneaky)
    with pytest.raises(RuntimeError, match="outside the safe allow-list"):
        load_checkpoint(torch.nn.Linear(2, 2), str(sneaky))
    # control: the explicit opt-in really unpickles, so the payload above is live and was refused
    monkeypatch.setitem(_mm._UNSAFE, "on", True)
    load_checkpoint(torch.nn.Linear(2, 2), str(bad), strict=False)
    assert os.path.isdir(marker)
