"""The Hub folder format (ttt_zoo/hub_format.py): every malformed config.json key is refused in one line naming the
key (HubFolderError from the API, `error:` + exit 2 from the command line); the weights' recorded sha256 is checked
by every loader (ours and timm's `local-dir:` path) while timm and transformers ignore it; `convert --force --out
LINK` replaces the link's target and keeps the link."""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import timm
from ttt_zoo import hub, hub_format
from ttt_zoo.cli import main as cli_main
from ttt_zoo.fileio import sha256_file
from ttt_zoo.hub.build import zoo_architectures

SMALL = {"img_size": 32, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2}


def _checkpoint(path, seed):
    torch.manual_seed(seed)
    torch.save(timm.create_model("vit3_tiny", num_classes=10, **SMALL).state_dict(), path)
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("fmt")
    src = _checkpoint(d / "src.pth", 0)
    out = str(d / "hub")
    hub.convert_checkpoint(src, "vit3_tiny.digits", out, model_args=SMALL, flops=False)
    return dict(src=src, folder=out)


def _copy(folder, tmp_path):
    out = str(tmp_path / "copy")
    shutil.copytree(folder["folder"], out)
    return out


def _config(path):
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _write_raw(path, text):
    with open(os.path.join(path, "config.json"), "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())


def _set(cfg, key, value):
    *parents, last = key.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value


_DELETE = object()

#: (case id, config.json key, value (or _DELETE), what the one line must name)
CASES = [
    ("no architecture", "architecture", _DELETE, "'architecture'"),
    ("architecture a number", "architecture", 42, "'architecture' is 42"),
    ("architecture outside the zoo", "architecture", "resnet50", "'architecture' 'resnet50' is not a ttt-zoo model"),
    ("no num_classes", "num_classes", _DELETE, "'num_classes'"),
    ("num_classes 0", "num_classes", 0, "'num_classes' is 0"),
    ("num_classes -3", "num_classes", -3, "'num_classes' is -3"),
    ("num_classes ten", "num_classes", "ten", "'num_classes' is \"ten\""),
    ("num_classes true", "num_classes", True, "'num_classes' is true"),
    ("num_classes 10.5", "num_classes", 10.5, "'num_classes' is 10.5"),
    ("pretrained_cfg num_classes differs", "pretrained_cfg.num_classes", 1000, "'pretrained_cfg.num_classes' is 1000"),
    ("no pretrained_cfg", "pretrained_cfg", _DELETE, "'pretrained_cfg'"),
    ("pretrained_cfg a list", "pretrained_cfg", [1, 2], "'pretrained_cfg' is [1, 2]"),
    ("no mean", "pretrained_cfg.mean", _DELETE, "'pretrained_cfg.mean'"),
    ("std 0", "pretrained_cfg.std", [0, 0, 0], "'pretrained_cfg.std' is [0, 0, 0]"),
    ("std negative", "pretrained_cfg.std", [0.2, -0.2, 0.2], "'pretrained_cfg.std'"),
    ("mean of 2 channels", "pretrained_cfg.mean", [0.5, 0.5], "'pretrained_cfg.mean' is [0.5, 0.5]"),
    ("mean NaN", "pretrained_cfg.mean", [float("nan")] * 3, "'pretrained_cfg.mean' is [NaN, NaN, NaN]"),
    ("unknown interpolation", "pretrained_cfg.interpolation", "cubic", "'pretrained_cfg.interpolation' is \"cubic\""),
    ("crop_pct 0", "pretrained_cfg.crop_pct", 0, "'pretrained_cfg.crop_pct' is 0"),
    ("crop_pct 2", "pretrained_cfg.crop_pct", 2, "'pretrained_cfg.crop_pct' is 2"),
    ("crop_mode", "pretrained_cfg.crop_mode", "zoom", "'pretrained_cfg.crop_mode' is \"zoom\""),
    ("input_size of 2", "pretrained_cfg.input_size", [3, 32], "'pretrained_cfg.input_size' is [3, 32]"),
    ("input_size 0", "pretrained_cfg.input_size", [3, 0, 32], "'pretrained_cfg.input_size' is [3, 0, 32]"),
    ("a key timm's PretrainedCfg refuses", "pretrained_cfg.crop_percent", 0.9, "'pretrained_cfg.crop_percent' is not a"),
    ("tag with a slash", "pretrained_cfg.tag", "my/tag", "'pretrained_cfg.tag' is \"my/tag\""),
    ("label_names short", "label_names", ["a", "b"], "'label_names' is [\"a\", \"b\"]"),
    ("model_args a list", "model_args", [1], "'model_args' is [1]"),
    ("model_args with a loader argument that contradicts num_classes", "model_args", dict(SMALL, num_classes=7),
     "'model_args' is"),
    ("weights_sha256 not a sha", "ttt_zoo.weights_sha256", "abc", "'ttt_zoo.weights_sha256' is \"abc\""),
    ("unknown kind", "ttt_zoo.kind", "robot", "'ttt_zoo.kind' is \"robot\""),
    ("ttt_zoo a string", "ttt_zoo", "x", "'ttt_zoo' is \"x\""),
]

#: (case id, raw config.json bytes, what the one line must say)
RAW = [
    ("not UTF-8", b'{"architecture": "vit3_tiny\xff"}', "is not UTF-8 text"),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, "is nested too deeply"),
    ("not JSON", b'{"architecture": ', "is not valid JSON"),
    ("a list", b"[1, 2]", "must hold a JSON object, got list"),
]


def _one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _exit_status(argv):
    try:
        return cli_main(argv)
    except SystemExit as e:  # commands that exit instead of returning
        return e.code


def _refused(path, needle, capsys, apis=(hub.load_folder, hub.read_config)):
    """The API (load_folder, read_config) raises HubFolderError and `push --dry-run` exits 2, each naming ``needle``."""
    for api in apis:
        with pytest.raises(hub.HubFolderError) as e:
            api(path)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    capsys.readouterr()
    assert cli_main(["push", path, "--dry-run", "--no-source-check"]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("case,key,value,needle", CASES, ids=[c[0] for c in CASES])
def test_every_malformed_key_is_one_line_naming_it(folder, tmp_path, capsys, case, key, value, needle):
    path = _copy(folder, tmp_path)
    cfg = _config(path)
    _set(cfg, key, value)
    _write_raw(path, json.dumps(cfg))
    _refused(path, needle, capsys)
    with pytest.raises(hub.HubFolderError, match=re.escape(needle)):  # the one writer refuses it too
        hub_format.write_config(str(tmp_path), cfg, zoo_architectures())
    assert not os.path.exists(tmp_path / "config.json")


@pytest.mark.parametrize("case,raw,needle", RAW, ids=[c[0] for c in RAW])
def test_unreadable_config_json_is_one_line(folder, tmp_path, capsys, case, raw, needle):
    path = _copy(folder, tmp_path)
    _write_raw(path, raw)
    _refused(path, needle, capsys)


def test_weights_that_do_not_fit_the_keys_are_one_line(folder, tmp_path, capsys):
    """A head the weights lack, or an architecture of another family: one line naming the keys."""
    path = _copy(folder, tmp_path)
    weights = os.path.join(path, "model.safetensors")
    w = load_file(weights)
    del w["head.weight"], w["head.bias"]
    save_file(w, weights, metadata={"format": "pt"})
    cfg = _config(path)
    cfg["ttt_zoo"]["weights_sha256"] = sha256_file(weights)  # recorded as it is: only the keys are wrong
    _write_raw(path, json.dumps(cfg))
    _refused(path, "'num_classes' 10", capsys, apis=(hub.load_folder,))
    shutil.copyfile(os.path.join(folder["folder"], "model.safetensors"), weights)
    cfg["ttt_zoo"]["weights_sha256"] = sha256_file(weights)
    cfg["architecture"] = "hvit3_tiny"
    _write_raw(path, json.dumps(cfg))
    _refused(path, "'architecture' 'hvit3_tiny'", capsys, apis=(hub.load_folder,))


def test_the_valid_folder_passes_every_reader(folder):
    cfg = hub.read_config(folder["folder"])
    assert set(hub_format.PROVENANCE_KEYS) >= set(cfg["ttt_zoo"])
    assert cfg["ttt_zoo"]["weights_sha256"] == sha256_file(os.path.join(folder["folder"], "model.safetensors"))
    assert hub.validate_folder(folder["folder"], source=folder["src"])["max_abs_diff"] == 0.0
    assert "| `ttt_zoo.weights_sha256` |" in hub_format.key_table()


def test_a_global_pool_of_ones_own_is_a_model_arg_every_loader_passes(tmp_path):
    """timm's PretrainedCfg has no global_pool field: a non-default one is recorded in model_args, which timm's
    loaders pass to the constructor; the folder loads and equals its source."""
    torch.manual_seed(2)
    model = timm.create_model("vit3_tiny", num_classes=10, global_pool="", **SMALL).eval()
    torch.save(model.state_dict(), tmp_path / "gp.pth")
    out = str(tmp_path / "hub")
    hub.convert_checkpoint(str(tmp_path / "gp.pth"), "vit3_tiny.digits", out, model_args=dict(SMALL, global_pool=""),
                           flops=False)
    cfg = _config(out)
    assert cfg["model_args"]["global_pool"] == "" and "global_pool" not in cfg["pretrained_cfg"]
    x = torch.randn(2, 3, 32, 32)
    for loaded in (hub.load_folder(out), timm.create_model(f"local-dir:{out}", pretrained=True).eval()):
        assert loaded.global_pool == ""
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert hub.validate_folder(out, source=str(tmp_path / "gp.pth"))["max_abs_diff"] == 0.0


def test_timm_and_transformers_ignore_the_recorded_sha256(folder):
    from timm.models._hub import load_model_config_from_path
    from transformers import TimmWrapperConfig
    pretrained_cfg, name, model_args = load_model_config_from_path(folder["folder"])
    assert name == "vit3_tiny" and model_args == _config(folder["folder"])["model_args"]
    assert "weights_sha256" not in json.dumps(pretrained_cfg) and "ttt_zoo" not in pretrained_cfg
    wrapper = TimmWrapperConfig.from_pretrained(folder["folder"])
    assert wrapper.architecture == "vit3_tiny" and wrapper.num_labels == 10


def test_a_bit_flip_in_the_weights_is_refused_by_every_loader(folder, tmp_path, capsys):
    path = _copy(folder, tmp_path)
    weights = os.path.join(path, "model.safetensors")
    data = bytearray(open(weights, "rb").read())
    data[-5] ^= 0x01  # the data section: the header (and so check_safetensors) is unchanged
    with open(weights, "wb") as f:
        f.write(bytes(data))
    needle = f"{weights} does not match the sha256 its config.json records ('ttt_zoo.weights_sha256'"
    for load in (hub.load_folder, lambda p: hub.validate_folder(p, source=folder["src"]),
                 lambda p: timm.create_model(f"local-dir:{p}", pretrained=True)):
        with pytest.raises(hub.HubFolderError) as e:
            load(path)
        assert needle in str(e.value)
    capsys.readouterr()
    assert cli_main(["push", path, "--dry-run", "--no-source-check"]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)
    image = tmp_path / "img.png"
    from PIL import Image
    Image.new("RGB", (40, 40), (120, 30, 200)).save(image)
    assert _exit_status(["predict", str(image), "--checkpoint", path]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)
    (tmp_path / "data" / "val" / "a").mkdir(parents=True)
    shutil.copyfile(image, tmp_path / "data" / "val" / "a" / "x.png")
    assert _exit_status(["validate", "--model", f"local-dir:{path}", "--pretrained", "--data-dir",
                         str(tmp_path / "data")]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)


def test_convert_force_out_a_symlink_replaces_its_target(folder, tmp_path, capsys):
    target = tmp_path / "store" / "vit3_tiny.digits"
    shutil.copytree(folder["folder"], target)
    (target / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    link = tmp_path / "links" / "current"
    link.parent.mkdir()
    link.symlink_to(target, target_is_directory=True)
    new_src = _checkpoint(tmp_path / "new.pth", 1)
    args = ["convert", new_src, "--model", "vit3_tiny.digits", "--model-args", json.dumps(SMALL), "--out", str(link),
            "--no-flops"]
    assert cli_main(args) == 2  # not empty, no --force: refused, nothing changed
    assert "exists and is not empty; pass --force" in _one_error_line(capsys.readouterr().err)
    assert cli_main(args + ["--force"]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target) and target.is_dir() and not target.is_symlink()
    model = hub.load_folder(str(link))
    for k, v in torch.load(new_src).items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    assert (target / ".gitattributes").read_text() == "*.safetensors filter=lfs\n"  # kept, as for a real folder
    left = [p for d in (link.parent, target.parent) for p in os.listdir(d) if ".partial-" in p]
    assert left == [] and sorted(os.listdir(link.parent)) == ["current"]
