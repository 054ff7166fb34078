"""pretrained=True paths with checkpoints written by the tests in every official layout; no network."""
import pickle
import sys
import types

import pytest
import timm
import torch
from safetensors.torch import save_file

from ttt_zoo.checkpoint import CheckpointError

HV = dict(embed_dim=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 2))


def _fake_yacs_module():
    """A class pickled as yacs.config.CfgNode, as in the official ViT3 checkpoints ('config' entry)."""
    mod = types.ModuleType("yacs.config")

    class CfgNode(dict):
        pass
    CfgNode.__module__ = "yacs.config"
    CfgNode.__qualname__ = "CfgNode"
    mod.CfgNode = CfgNode
    return mod


def _save_with_yacs_config(obj, path):
    pkg, mod = types.ModuleType("yacs"), _fake_yacs_module()
    sys.modules["yacs"], sys.modules["yacs.config"] = pkg, mod
    try:
        cfg = mod.CfgNode(MODEL=mod.CfgNode(TYPE="vittt", DROP_PATH_RATE=0.1))
        torch.save(dict(obj, config=cfg), path)
    finally:
        del sys.modules["yacs"], sys.modules["yacs.config"]


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def _assert_same_weights(model, sd):
    own = model.state_dict()
    for k, v in sd.items():
        torch.testing.assert_close(own[k], v, rtol=0, atol=0, msg=k)


def test_vit3_official_layout_with_config_object(tmp_path):
    src = timm.create_model("vit3_tiny", depth=2)
    sd = src.state_dict()
    path = tmp_path / "vit3_t.pth"
    _save_with_yacs_config({"model": sd, "optimizer": {}, "epoch": 299, "max_accuracy": 76.5}, path)
    model = timm.create_model("vit3_tiny", depth=2, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    _assert_same_weights(model, sd)


def test_hvit3_ema_is_chosen(tmp_path):
    ema, raw = timm.create_model("hvit3_tiny", **HV), timm.create_model("hvit3_tiny", **HV)
    path = tmp_path / "hvit3_t.pth"
    torch.save({"model": raw.state_dict(), "state_dict_ema": ema.state_dict(), "epoch": 1}, path)
    model = timm.create_model("hvit3_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **HV)
    _assert_same_weights(model, ema.state_dict())


def test_safetensors_and_num_classes_change(tmp_path):
    src = timm.create_model("hvit3_tiny", **HV)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    model = timm.create_model("hvit3_tiny", pretrained=True, num_classes=10,
                              pretrained_cfg_overlay=dict(file=str(path)), **HV)
    _assert_same_weights(model, {k: v for k, v in src.state_dict().items() if not k.startswith("head.")})
    assert model.head.out_features == 10


def test_arbitrary_pickles_are_refused(tmp_path):
    path = tmp_path / "evil.pth"

    torch.save({"model": timm.create_model("vit3_tiny", depth=1).state_dict(), "x": _Evil()}, path)
    with pytest.raises(CheckpointError, match=r"Refusing to unpickle .*GLOBAL print") as err:
        timm.create_model("vit3_tiny", depth=1, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert "weights_only" not in str(err.value)


def test_mismatched_checkpoint_is_explained(tmp_path):
    path = tmp_path / "small.pth"
    torch.save({"model": timm.create_model("vit3_small", depth=1).state_dict()}, path)
    with pytest.raises(CheckpointError, match=r"shape mismatches .*another model size.*patch_embed.proj.weight"):
        timm.create_model("vit3_tiny", depth=1, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    path2 = tmp_path / "deeper.pth"
    torch.save({"model": timm.create_model("vit3_tiny", depth=2).state_dict()}, path2)
    with pytest.raises(CheckpointError, match=r"unexpected keys: \['blocks.1"):
        timm.create_model("vit3_tiny", depth=1, pretrained=True, pretrained_cfg_overlay=dict(file=str(path2)))


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_corrupt_or_missing_files(tmp_path, suffix):
    src = timm.create_model("vit3_tiny", depth=1)
    path = tmp_path / ("w" + suffix)
    if suffix == ".pth":
        torch.save({"model": src.state_dict()}, path)
    else:
        save_file(src.state_dict(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        timm.create_model("vit3_tiny", depth=1, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    with pytest.raises(CheckpointError, match="does not exist"):
        timm.create_model("vit3_tiny", depth=1, pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(tmp_path / ("missing" + suffix))))


def test_official_url_uses_named_cache_file(tmp_path, monkeypatch):
    """The authors' links end in '/?dl=1' (no file name); a file cached under our name is used, no download."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    torch.hub.set_dir(str(tmp_path / "hub"))
    cfg = timm.models.get_pretrained_cfg("vit3_tiny.in1k")
    assert cfg.url.startswith("https://cloud.tsinghua.edu.cn/f/") and cfg.url.endswith("/?dl=1")
    src = timm.create_model("vit3_tiny")
    cache = tmp_path / "hub" / "checkpoints" / "ttt_zoo"
    cache.mkdir(parents=True)
    _save_with_yacs_config({"model": src.state_dict()}, cache / "vit3_tiny.in1k.pth")

    def no_network(*a, **k):
        raise AssertionError("tried to download")
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    model = timm.create_model("vit3_tiny", pretrained=True)
    _assert_same_weights(model, src.state_dict())
