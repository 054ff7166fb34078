"""Issue 45, item 4: what enters is checked where it enters.

- weights (``ttt_zoo.checkpoint``): NaN / infinity in a float tensor and float tensors stored as integers are
  refused in one line naming the file and the tensor, on every load path (a file, ``pretrained=True`` with
  ``file=``, a Hub folder, convert);
- a Hub ``config.json``'s preprocessing numbers (``mean``, ``std``, ``crop_pct``, ``input_size``) are in range;
- every registered model's constructor refuses sizes out of range (``depth``, ``num_heads``, ``embed_dim``,
  ``num_classes``, ...) with a ValueError naming the argument, so a new model cannot slip past.
"""
import json
import os
import shutil

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import ttt_zoo
from ttt_zoo.checkpoint import CheckpointError, WeightsError, load_checkpoint_file, validate_state_dict
from ttt_zoo.registry import list_zoo_models

TINY = dict(depth=1, embed_dim=16, num_heads=2, patch_size=4, img_size=16, num_classes=10)


def tiny():
    torch.manual_seed(0)
    return timm.create_model("vit3_tiny", **TINY)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    path = root / "good.safetensors"
    save_file(tiny().state_dict(), path)
    return path


def _edited(good, path, edit):
    sd = load_file(good)
    edit(sd)
    if str(path).endswith(".safetensors"):
        save_file(sd, path)
    else:
        torch.save({"model": sd}, path)  # the official layout
    return str(path)


# ----- weights -----

@pytest.mark.parametrize("value,kind", [(float("nan"), "NaN"), (float("inf"), "an infinity")])
@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_file_with_non_finite_weights_is_refused_naming_file_and_tensor(good, tmp_path, value, kind, suffix):
    path = _edited(good, tmp_path / f"bad{suffix}", lambda sd: sd["head.bias"].__setitem__(3, value))
    with pytest.raises(WeightsError) as e:
        load_checkpoint_file(path)
    msg = str(e.value)
    assert msg.startswith(path) and "'" in msg and "head.bias" in msg and f"holds {kind} (1 of 10 values)" in msg


def test_an_optimizer_state_is_no_weight(good, tmp_path):
    path = tmp_path / "state.pth"
    torch.save({"model": load_file(good), "optimizer": {"state": {0: {"exp_avg": torch.tensor([float("nan")])}}}},
               path)
    assert "model" in load_checkpoint_file(str(path))


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_float_weights_stored_as_integers_are_refused_by_pretrained_file(good, tmp_path, suffix):
    path = _edited(good, tmp_path / f"int{suffix}", lambda sd: sd.update(
        {k: (v * 100).to(torch.int32) for k, v in sd.items() if k.startswith("blocks.")}))
    with pytest.raises(WeightsError, match="is stored as int32, but the model's is float32") as e:
        timm.create_model("vit3_tiny", pretrained=True, pretrained_cfg_overlay=dict(file=path), **TINY)
    assert str(e.value).startswith(path + ": tensor 'blocks.")


def test_validate_state_dict_checks_values_of_a_state_dict():
    model = tiny()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    validate_state_dict(sd, model)
    sd["norm.weight"][0] = float("nan")
    with pytest.raises(WeightsError, match="the checkpoint: tensor 'norm.weight' holds NaN"):
        validate_state_dict(sd, model)
    sd["norm.weight"] = torch.ones(16, dtype=torch.int64)
    with pytest.raises(WeightsError, match="'norm.weight' is stored as int64"):
        validate_state_dict(sd, model)


def test_a_transposed_head_says_so_without_contradiction():
    model = tiny()
    sd = dict(model.state_dict(), **{"head.weight": model.state_dict()["head.weight"].t()})
    with pytest.raises(CheckpointError) as e:
        validate_state_dict(sd, model, ignore_prefixes=())  # a model's own weights: the head too
    msg = str(e.value)
    assert "head.weight is stored transposed: (16, 10)" in msg and "(10, 16)" in msg and "weight.t()" in msg
    assert "num_classes=16" not in msg and "16 classes" not in msg and "Build the model" not in msg
    other = dict(model.state_dict(), **{"head.weight": torch.zeros(5, 16), "head.bias": torch.zeros(5)})
    with pytest.raises(CheckpointError, match="has 5 classes and the model 10: build the model with num_classes=5"):
        validate_state_dict(other, model, ignore_prefixes=())


@pytest.fixture(scope="module")
def hub(good, tmp_path_factory):
    from ttt_zoo.hub import convert_checkpoint
    out = tmp_path_factory.mktemp("hub") / "folder"
    convert_checkpoint(str(good), "vit3_tiny.checks", str(out), model_args=TINY, flops=False)
    return out


def test_a_hub_folder_with_nan_weights_names_its_file(hub, tmp_path):
    from ttt_zoo import hub_format as fmt
    from ttt_zoo.hub.load import load_folder
    folder = tmp_path / "nan"
    shutil.copytree(hub, folder)
    weights = folder / "model.safetensors"
    sd = load_file(weights)
    sd["head.bias"][:] = float("nan")
    save_file(sd, weights, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["ttt_zoo"] = fmt.with_weights_sha256(cfg["ttt_zoo"], str(folder))  # a consistent folder, damaged weights
    (folder / "config.json").write_text(json.dumps(cfg))
    for load in (lambda: load_folder(str(folder)), lambda: timm.create_model(f"local-dir:{folder}", pretrained=True)):
        with pytest.raises(WeightsError) as e:
            load()
        assert str(e.value).startswith(f"{weights}: tensor 'head.bias' holds NaN (10 of 10 values)"), str(e.value)


# ----- config.json preprocessing numbers -----

@pytest.mark.parametrize("key,value,phrase", [
    ("std", [1e-300] * 3, "'pretrained_cfg.std' is [1e-300, 1e-300, 1e-300]; it must be a list of 3 numbers, each "
                          "0.001 <= x <= 10"),
    ("std", [0.2, 100, 0.2], "'pretrained_cfg.std' is [0.2, 100, 0.2]"),
    ("mean", [0.5, 7, 0.5], "'pretrained_cfg.mean' is [0.5, 7, 0.5]"),
    ("crop_pct", 1e-9, "'pretrained_cfg.crop_pct' is 1e-09; it must be a number 0.5 <= x <= 1"),
    ("input_size", [3, 60000, 60000], "'pretrained_cfg.input_size' is [3, 60000, 60000]; it must be [channels, "
                                      "height, width] with channels in [1, 1024] and sides in [1, 8192]"),
])
def test_preprocessing_numbers_out_of_range_are_refused(hub, key, value, phrase):
    from ttt_zoo import hub_format as fmt
    from ttt_zoo.errors import HubFolderError
    cfg = json.loads((hub / "config.json").read_text())
    fmt.validate_config(cfg)
    cfg["pretrained_cfg"][key] = value
    with pytest.raises(HubFolderError, match=None) as e:
        fmt.validate_config(cfg)
    assert phrase in str(e.value), str(e.value)


@pytest.mark.parametrize("key", ["features_only", "device", "pretrained_cfg_overlay"])
def test_create_model_options_are_no_model_args(hub, key):
    from ttt_zoo import hub_format as fmt
    from ttt_zoo.errors import HubFolderError
    from ttt_zoo.flags import model_kwargs_problem
    assert model_kwargs_problem({key: True}).startswith(f"{key}=True is not a constructor argument; ")
    cfg = json.loads((hub / "config.json").read_text())
    cfg["model_args"][key] = True
    with pytest.raises(HubFolderError, match=f"constructor arguments only, without {key}"):
        fmt.validate_config(cfg)


def test_out_of_memory_line():
    from ttt_zoo.flags import out_of_memory
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 2415919104 bytes. Error code 12 (Cannot allocate memory)")
    assert out_of_memory(cpu, (8192, 8192), 64) == (
        "out of memory allocating 2.2 GiB at --img-size 8192, -b 64: memory grows with the image area and the batch "
        "size; give --img-size 4096 (a quarter of the memory) or -b 16")
    assert "--img-size 512x256" in out_of_memory(MemoryError(), (1024, 512), 1)
    assert out_of_memory(RuntimeError("shape mismatch"), 224, 8) is None and out_of_memory(ValueError("x")) is None


# ----- constructor sizes, every registered model -----

#: each group: the spellings the families use, with values out of range (ints and per-stage lists)
SIZE_GROUPS = {
    "depth": [("depth", -1), ("depth", 0), ("depths", (1, 0, 1, 1)), ("depths", -1)],
    "width": [("embed_dim", 0), ("embed_dim", -8), ("embed_dim", (16, 0, 32, 32)), ("hidden_size", 0)],
    "heads": [("num_heads", 0), ("num_heads", (2, 0, 2, 2)), ("head_dim", 0), ("head_dim", (32, 0, 32, 32))],
    "classes": [("num_classes", -5)],
}
ALL = list_zoo_models(include_diffusion=True)


@pytest.mark.parametrize("name", ALL)
def test_every_model_refuses_sizes_out_of_range_naming_the_argument(name):
    """Each value either is not this model's argument (TypeError naming it) or is refused with a ValueError naming
    it, before anything is built; every group has an argument the model takes."""
    for group, cases in SIZE_GROUPS.items():
        refused = []
        for arg, value in cases:
            with pytest.raises((TypeError, ValueError)) as e:
                timm.create_model(name, **{arg: value})
            if e.type is ValueError:
                assert f"{arg}={value!r}" in str(e.value), (name, arg, value, str(e.value))
                refused.append(arg)
            else:
                assert arg in str(e.value), (name, arg, str(e.value))
        assert refused, f"{name} takes none of {[a for a, _ in cases]} ({group}): add its spelling here"


@pytest.mark.parametrize("name,kwargs", [
    ("vit3_tiny", dict(embed_dim=30, num_heads=4)), ("t5_tiny", dict(embed_dim=30, num_heads=4)),
    ("dit_s_2", dict(hidden_size=30, num_heads=4)), ("dit3_s_2", dict(hidden_size=30, num_heads=4)),
    ("hvit3_tiny", dict(embed_dim=(64, 128, 320, 500))), ("visionttt_tiny", dict(embed_dim=30, head_dim=4)),
])
def test_width_not_divisible_by_heads_is_refused(name, kwargs):
    with pytest.raises(ValueError, match="not divisible by"):
        timm.create_model(name, **kwargs)


def test_good_sizes_still_build():
    assert len(tiny().blocks) == 1
    m = timm.create_model("vit3_tiny", **dict(TINY, num_classes=0))
    assert isinstance(m.head, torch.nn.Identity)
    with pytest.raises(ValueError, match="num_classes=-1 is out of range"):
        m.reset_classifier(-1)
    assert ttt_zoo.models is not None
