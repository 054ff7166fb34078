"""Hub folders in the layout of the ``timm/`` organisation's repositories (issue 30, item 5).

config.json is compared key by key with what timm's own ``save_config_for_hf`` writes for the same model (one model
per family of the registry); ``model_args`` never repeats what loaders pass themselves; model.safetensors carries
``{'format': 'pt'}``; the folder loads back through timm's ``hf-hub:`` path (offline cache) and through a client
that passes the loader arguments itself (as transformers' TimmWrapper does), with the same weights bit for bit.
Custom tags name a user's own weights; only the authors' release gets the authors' numbers on its card.
"""
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import timm
from timm.models import get_pretrained_cfg
from timm.models._hub import load_model_config_from_hf, save_config_for_hf

import ttt_zoo
from ttt_zoo import hub
from ttt_zoo.cli import main as cli_main
from ttt_zoo.hub.cards import parse_card

#: what loaders pass to the constructor themselves (timm _builder._update_default_model_kwargs: num_classes,
#: global_pool, in_chans from the config / pretrained_cfg.input_size); other clients pass them explicitly
LOADER_ARGS = {"num_classes", "global_pool", "in_chans"}
#: top-level keys of timm's published config.json (timm/models/_hub.py save_config_for_hf: architecture,
#: num_classes, num_features, global_pool when the model pools with a named pool, pretrained_cfg; label_names /
#: label_descriptions where known; model_args only where the name does not rebuild the model)
TIMM_KEYS = {"architecture", "num_classes", "num_features", "global_pool", "pretrained_cfg"}
TIMM_LABEL_KEYS = {"label_names", "label_descriptions"}
#: keys we add on purpose: provenance (source file and sha256, hub id, measured params / GMACs); validate_folder
#: and push_folder read it, timm's loaders ignore unknown top-level keys
INTENDED_EXTRAS = {"ttt_zoo"}
#: keys of timm's output we leave out on purpose: its model_args of a model built from its name only repeats
#: LOADER_ARGS (asserted below), which clients that pass them themselves refuse
DROPPED_FROM_TIMM = {"model_args"}

SMALL_VIT3 = {"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 2}
FAMILIES = ttt_zoo.list_zoo_families(include_diffusion=True)


def _read(folder, name="config.json"):
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return json.load(f) if name.endswith(".json") else f.read()


def _known_labels(name, num_classes):
    """What timm's published ImageNet-1k repos carry (timm.data.ImageNetInfo), for 1000-class in1k tags."""
    if num_classes != 1000 or "in1k" not in name.partition(".")[2]:
        return {}
    info = timm.data.ImageNetInfo()
    names = list(info.label_names())
    return dict(label_names=names, label_descriptions={n: info.label_name_to_description(n) for n in names})


def _timm_reference(model, path, labels):
    """config.json as timm's own save_config_for_hf writes it for ``model`` (the published repos' layout)."""
    added = not hasattr(model, "num_features")  # DiT-style models: timm reads the attribute
    if added:
        model.num_features = None
    try:
        save_config_for_hf(model, path, model_config=dict(labels))
    finally:
        if added:
            del model.num_features
    with open(path) as f:
        return json.load(f)


def _same_weights(state_dict, reference):
    assert state_dict.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(state_dict[k], v), k


def _client_passing_loader_args(cfg, weights):
    """A client that builds the model itself with the loader arguments, then the config's model_args (the way
    transformers' TimmWrapper calls timm.create_model), and loads the weights strictly."""
    model = timm.create_model(cfg["architecture"], pretrained=False, num_classes=cfg["num_classes"],
                              in_chans=cfg["pretrained_cfg"]["input_size"][0], **cfg.get("model_args", {}))
    model.load_state_dict(load_file(weights), strict=True)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory):
    """The smallest model of each family (from the registry) with seeded weights, converted once."""
    arch = FAMILIES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = timm.create_model(arch).eval()
    src = str(d / f"{arch}.pth")
    torch.save({"model": model.state_dict()}, src)
    info = hub.convert_checkpoint(src, arch, str(d / "hub"), flops=False)
    return dict(arch=arch, model=model, src=src, folder=str(d / "hub"), info=info, dir=d)


def test_config_keys_match_timm_published_layout(converted):
    model, folder = converted["model"], converted["folder"]
    ours = _read(folder)
    labels = _known_labels(converted["info"]["name"], model.num_classes)
    ref = _timm_reference(model, str(converted["dir"] / "timm_config.json"), labels)
    assert set(ref) <= TIMM_KEYS | TIMM_LABEL_KEYS | DROPPED_FROM_TIMM, set(ref)  # the written-down set holds
    assert set(ref.get("model_args", {})) <= LOADER_ARGS, ref["model_args"]  # timm's repeats, nothing else
    assert set(ours) == (set(ref) - DROPPED_FROM_TIMM) | INTENDED_EXTRAS
    for key in set(ref) - DROPPED_FROM_TIMM:  # same values, pretrained_cfg included (same keys, same entries)
        assert ours[key] == ref[key], key
    assert "model_args" not in ours  # built from its name: nothing to add
    assert bool(labels) == ("label_names" in ours)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_loads_back_through_timm_and_other_clients_bit_for_bit(converted, hf_cache):
    arch, folder = converted["arch"], converted["folder"]
    want = converted["model"].state_dict()
    repo = f"ttt-zoo/{converted['info']['name']}"
    hub.install_to_hub_cache(folder, repo)
    _same_weights(timm.create_model(f"hf-hub:{repo}", pretrained=True).state_dict(), want)
    pretrained_cfg, name, model_args = load_model_config_from_hf(repo)  # timm's own reader of the hub config
    assert name == arch and not (set(model_args) & LOADER_ARGS)
    _same_weights(_client_passing_loader_args(_read(folder), os.path.join(folder, "model.safetensors"))
                  .state_dict(), want)


def test_model_args_only_what_the_name_cannot_rebuild(tmp_path, hf_cache):
    """A non-default build (small ViT3, 1 input channel, 10 classes): model_args holds the architecture arguments,
    the loader arguments live where timm's loaders read them; timm's own save_config_for_hf repeats them, and a
    client that passes them itself refuses timm's file but reads ours."""
    torch.manual_seed(0)
    model = timm.create_model("vit3_tiny", in_chans=1, num_classes=10, **SMALL_VIT3).eval()
    src = str(tmp_path / "small.pth")
    torch.save({"model": model.state_dict()}, src)
    folder = str(tmp_path / "hub")
    hub.convert_checkpoint(src, "vit3_tiny.digits", folder, model_args=dict(SMALL_VIT3, in_chans=1), flops=False)
    cfg = _read(folder)
    assert cfg["model_args"] == dict(SMALL_VIT3, img_size=[32, 32])
    assert cfg["num_classes"] == 10 and cfg["pretrained_cfg"]["input_size"] == [1, 32, 32]

    timm_cfg = _timm_reference(model, str(tmp_path / "timm_config.json"), {})
    assert LOADER_ARGS <= set(timm_cfg["model_args"])  # what timm 1.0.31 writes
    with pytest.raises(TypeError, match="multiple values for keyword argument"):
        _client_passing_loader_args(timm_cfg, os.path.join(folder, "model.safetensors"))
    weights = os.path.join(folder, "model.safetensors")
    _same_weights(_client_passing_loader_args(cfg, weights).state_dict(), model.state_dict())
    hub.install_to_hub_cache(folder, "ttt-zoo/vit3_tiny.digits")
    loaded = timm.create_model("hf-hub:ttt-zoo/vit3_tiny.digits", pretrained=True)
    assert loaded.num_classes == 10 and loaded.pretrained_cfg["tag"] == "digits"
    _same_weights(loaded.state_dict(), model.state_dict())
    assert hub.validate_folder(folder, source=src)["max_abs_diff"] == 0.0  # rebuilt from the slimmer config


# ----- custom tags and the authors' numbers -----

def _card(folder):
    return parse_card(_read(folder, "README.md"))


def _assert_no_authors_results(body):
    assert "76.5" not in body and "reported by the authors (" not in body
    assert "No results reported by the authors apply to this checkpoint" in body


@pytest.fixture(scope="module")
def default_vit3(tmp_path_factory):
    """Random weights of the released ViT3-T architecture (not the authors' file)."""
    d = tmp_path_factory.mktemp("vit3_default")
    torch.manual_seed(1)
    model = timm.create_model("vit3_tiny").eval()
    src = str(d / "random.pth")
    torch.save({"model": model.state_dict()}, src)
    return dict(src=src, model=model)


@pytest.mark.parametrize("cli", [["--model", "vit3_tiny.digits"], ["--model", "vit3_tiny", "--tag", "digits"]])
def test_custom_tag_names_the_users_weights(cli, tmp_path, capsys):
    torch.manual_seed(2)
    model = timm.create_model("vit3_tiny", num_classes=10, **SMALL_VIT3).eval()
    src = str(tmp_path / "finetune.pth")
    torch.save({"model": model.state_dict()}, src)
    out = str(tmp_path / "out")
    assert cli_main(["convert", src, *cli, "--model-args", json.dumps(SMALL_VIT3), "--out", out, "--no-flops"]) == 0
    assert "hub id ttt-zoo/vit3_tiny.digits" in capsys.readouterr().out
    cfg = _read(out)
    assert cfg["pretrained_cfg"]["tag"] == "digits" and cfg["ttt_zoo"]["hub_id"] == "ttt-zoo/vit3_tiny.digits"
    meta, body = _card(out)
    assert "# Model card for vit3_tiny.digits" in body and "hf-hub:ttt-zoo/vit3_tiny.digits" in body
    assert "datasets" not in meta and "ttt-zoo/vit3_tiny.in1k" not in body
    assert "cloud.tsinghua.edu.cn" not in body  # the authors' release is not this file
    assert "timm.create_model('vit3_tiny.digits', pretrained=True)" not in body  # no registered cfg finds it
    _assert_no_authors_results(body)
    _same_weights(hub.load_folder(out).state_dict(), model.state_dict())
    assert hub.validate_folder(out, source=src)["max_abs_diff"] == 0.0


def test_custom_tag_refusals(default_vit3, tmp_path, capsys):
    out = str(tmp_path / "o")
    assert cli_main(["convert", default_vit3["src"], "--model", "vit3_tiny.in1k", "--tag", "digits",
                     "--out", out]) == 2
    assert "already has the tag 'in1k'; --tag digits names another" in capsys.readouterr().err
    assert cli_main(["convert", default_vit3["src"], "--model", "vit3_tiny", "--tag", "my/tag", "--out", out]) == 2
    assert "Invalid tag 'my/tag'" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_authors_numbers_only_for_their_release(default_vit3, tmp_path, monkeypatch):
    """76.5 (ViT3-T top-1) is stated for vit3_tiny.in1k converted from the cfg's released file (downloaded by the
    converter, from the pretrained=True cache, or named with --source-url); never for other weights."""
    url = get_pretrained_cfg("vit3_tiny.in1k").url
    src = default_vit3["src"]

    def card(name, **kw):
        folder = str(tmp_path / f"{name}-{len(os.listdir(tmp_path))}")
        hub.convert_checkpoint(src, name, folder, flops=False, **kw)
        return _card(folder)[1]

    assert "| ImageNet-1k val top-1 (%) | 76.5 | reported by the authors (Table 7" in card("vit3_tiny.in1k",
                                                                                         source_url=url)
    _assert_no_authors_results(card("vit3_tiny.in1k"))  # a local file: not known to be the release
    _assert_no_authors_results(card("vit3_tiny.in1k", source_url="https://example.com/mine.pth"))
    _assert_no_authors_results(card("vit3_tiny.digits", source_url=url))  # a custom tag is never the release

    head10 = timm.create_model("vit3_tiny", num_classes=10)  # a fine-tune's head on the released backbone
    finetune = str(tmp_path / "ft.pth")
    torch.save({"model": head10.state_dict()}, finetune)
    folder = str(tmp_path / "ft")
    hub.convert_checkpoint(finetune, "vit3_tiny.in1k", folder, flops=False, source_url=url)
    _assert_no_authors_results(_card(folder)[1])

    # convert --all from where pretrained=True caches the authors' files: the release, numbers stated
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    os.makedirs(hub.default_checkpoint_dir())
    os.link(src, os.path.join(hub.default_checkpoint_dir(), "vit3_tiny.in1k.pth"))
    res = hub.convert_all(str(tmp_path / "all"), pattern="vit3_tiny.*", flops=False, log=lambda s: None)
    assert list(res["converted"]) == ["vit3_tiny.in1k"]
    body = _card(res["converted"]["vit3_tiny.in1k"])[1]
    assert "| ImageNet-1k val top-1 (%) | 76.5 | reported by the authors" in body
    assert f"downloaded from the authors' release <{url}>" in body
