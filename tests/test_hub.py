"""Hub folders: conversion, cards, timm's real hf-hub / local-dir loading offline, hub-id fallback, push, errors.

Sources are fixture-derived checkpoints written in the official layouts ({'model': sd} from ViT3's main.py,
mmengine's {'meta', 'state_dict': {'backbone.*'}}); the official fixture outputs are the reference.
"""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import timm
from timm.models import get_pretrained_cfg

from ttt_zoo import hub
from ttt_zoo.cli import main as cli_main
from ttt_zoo.hub.cards import parse_card
from ttt_zoo.checkpoint import CheckpointError
from ttt_zoo.fileio import sha256_file

from fixtures import load_fixture

VIT3_ARGS = {"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 2}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_official(path, sd, layout="model"):
    if layout == "model":
        ckpt = {"model": sd, "epoch": 299, "max_accuracy": 76.5}
    else:  # mmengine detection / segmentation checkpoint
        ckpt = {"meta": {"epoch": 12}, "state_dict": {"backbone." + k: v for k, v in sd.items()}}
    torch.save(ckpt, path)
    return str(path)


@pytest.fixture(scope="module")
def vit3(tmp_path_factory):
    """The ViT3 fixture as an official checkpoint, converted once (GMACs measured)."""
    tensors, sd, meta, tol = load_fixture("vit3_model_tiny")
    d = tmp_path_factory.mktemp("vit3")
    src = _write_official(d / "vit3_fixture.pth", sd)
    folder = str(d / "vit3_tiny.fixture")
    info = hub.convert_checkpoint(src, "vit3_tiny.in1k", folder, model_args=VIT3_ARGS)
    return dict(src=src, folder=folder, info=info, tensors=tensors, sd=sd, dir=d)


@pytest.fixture
def no_network(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("this test must not touch the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)


# ----- conversion output -----

def test_convert_writes_safetensors_config_and_card(vit3):
    folder = vit3["folder"]
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    weights = load_file(os.path.join(folder, "model.safetensors"))
    # every official tensor is carried over unchanged (float64 fixture -> float32 folder)
    assert set(weights) == set(vit3["sd"])
    for k, v in vit3["sd"].items():
        torch.testing.assert_close(weights[k], v.float(), rtol=0, atol=0)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["architecture"] == "vit3_tiny" and cfg["num_classes"] == 10
    assert {k: cfg["model_args"][k] for k in ("patch_size", "embed_dim", "depth", "num_heads")} == \
        {"patch_size": 4, "embed_dim": 64, "depth": 2, "num_heads": 2}
    assert cfg["pretrained_cfg"]["input_size"] == [3, 32, 32]
    assert "label_names" not in cfg  # 10 classes: no ImageNet names claimed
    assert cfg["ttt_zoo"]["source_sha256"] == sha256_file(vit3["src"])
    assert cfg["ttt_zoo"]["params"] == sum(v.numel() for v in vit3["sd"].values())  # no buffers in ViT3


def _check_markdown(body):
    assert body.count("```") % 2 == 0, "unbalanced code fences"
    lines = body.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| ---"):
            cols = lines[i - 1].count("|")
            j = i + 1
            while j < len(lines) and lines[j].startswith("|"):
                assert lines[j].count("|") == cols, f"table row with wrong column count: {lines[j]}"
                j += 1
    assert re.search(r"^# Model card for ", body, re.M)


def test_card_metadata_and_honest_sources(vit3):
    text = open(os.path.join(vit3["folder"], "README.md")).read()
    meta, body = parse_card(text)
    assert meta["license"] == "apache-2.0" and meta["library_name"] == "timm"
    assert "arxiv:2512.01643" in meta["tags"] and "image-classification" in meta["tags"]
    _check_markdown(body)
    n = sum(v.numel() for v in vit3["sd"].values())
    assert f"| parameters | {n:,} | measured by ttt-zoo" in body
    assert re.search(r"\| GMACs, input 3x32x32 \| [0-9.]+ \| measured by ttt-zoo", body)
    # fixture weights are not the released ViT3-T: no paper numbers, no dataset, no release claimed
    assert "76.5" not in body and "reported by the authors (" not in body and "datasets" not in meta
    assert "No results reported by the authors apply to this checkpoint" in body
    assert "do not belong to the released `vit3_tiny`" in body
    assert "not verified to be the authors' release" in body
    assert "hf-hub:ttt-zoo/vit3_tiny.in1k" in body and "torch.hub.load(" in body and "@inproceedings" in body


def test_convert_all_registered_tags_paper_numbers(tmp_path):
    """One command over the registry.  The source here is random weights from a folder of the user's, not the
    authors' release: the card states no paper numbers (those need the released file, tests/test_hub_layout.py)."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    model = timm.create_model("vit3_tiny")
    _write_official(ckpts / "vit3_tiny.in1k.pth", model.state_dict())
    out = tmp_path / "hub"
    with pytest.raises(hub.HubFolderError, match=r"No source checkpoint in .* for .*hvit3_base.in1k, .*vit3_small.in1k"):
        hub.convert_all(str(out), str(ckpts))
    res = hub.convert_all(str(out), str(ckpts), skip_missing=True, log=lambda s: None)
    assert list(res["converted"]) == ["vit3_tiny.in1k"]
    assert sorted(res["missing"]) == sorted(set(hub.registered_pretrained()) - {"vit3_tiny.in1k"})
    cfg = json.load(open(out / "vit3_tiny.in1k" / "config.json"))
    assert cfg["ttt_zoo"]["params"] == 6_149_416  # official count, spec §2
    assert abs(cfg["ttt_zoo"]["gmacs"] - 1.2) / 1.2 < 0.03  # paper: 1.2 GFLOPs (MACs) at 224
    assert len(cfg["label_names"]) == 1000 and cfg["label_names"][0] == "n01440764"  # ImageNet-1k synsets
    assert cfg["label_descriptions"]["n01440764"].startswith("tench")
    meta, body = parse_card(open(out / "vit3_tiny.in1k" / "README.md").read())
    assert meta["datasets"] == ["imagenet-1k"]
    assert "76.5" not in body and "reported by the authors (" not in body
    assert "No results reported by the authors apply to this checkpoint" in body
    assert "| parameters | 6,149,416 | measured by ttt-zoo" in body
    assert "timm.create_model('vit3_tiny.in1k', pretrained=True)" in body


# ----- loading through timm's real hub paths -----

def _logits(model, tensors):
    with torch.no_grad():
        return model(tensors["input.x"].float()).double()


def test_hf_hub_offline_and_local_dir_load(vit3, hf_cache):
    tensors = vit3["tensors"]
    tol = dict(rtol=1e-5, atol=1e-5)  # float32 folder vs the official float64 run
    snap = hub.install_to_hub_cache(vit3["folder"], "ttt-zoo/vit3_tiny.fixture")
    assert snap.startswith(hf_cache) and os.path.islink(os.path.join(snap, "model.safetensors"))
    model = timm.create_model("hf-hub:ttt-zoo/vit3_tiny.fixture", pretrained=True).eval()
    assert model.pretrained_cfg["source"] == "hf-hub" and model.num_classes == 10
    torch.testing.assert_close(_logits(model, tensors), tensors["output"], **tol)
    # cache passed explicitly instead of through the environment
    other = os.path.join(os.path.dirname(hf_cache), "explicit_cache")
    hub.install_to_hub_cache(vit3["folder"], "someone/vit3-copy", cache_dir=other)
    model = timm.create_model("hf-hub:someone/vit3-copy", pretrained=True, cache_dir=other).eval()
    torch.testing.assert_close(_logits(model, tensors), tensors["output"], **tol)
    model = timm.create_model(f"local-dir:{vit3['folder']}", pretrained=True).eval()
    torch.testing.assert_close(_logits(model, tensors), tensors["output"], **tol)


def test_torch_hub_entry_points(vit3):
    tensors = vit3["tensors"]
    model = torch.hub.load(REPO_ROOT, "create_model", f"local-dir:{vit3['folder']}", pretrained=True,
                           source="local").eval()
    torch.testing.assert_close(_logits(model, tensors), tensors["output"], rtol=1e-5, atol=1e-5)
    model = torch.hub.load(REPO_ROOT, "vit3_tiny", source="local", **VIT3_ARGS, num_classes=10)
    assert model.num_classes == 10


def test_hub_ids_follow_the_naming_scheme():
    names = hub.registered_pretrained()
    assert {"vit3_tiny.in1k", "hvit3_base.in1k"} <= set(names)
    for n in names:
        pc = get_pretrained_cfg(n)
        if pc.url:
            assert pc.hf_hub_id == f"ttt-zoo/{n}", n


def _tiny_pretrained_vit3(**kw):
    return timm.create_model("vit3_tiny", pretrained=True, **VIT3_ARGS, num_classes=10, **kw)


def _same_backbone(model, sd):
    own = model.state_dict()
    return all(torch.equal(own[k], v.float()) for k, v in sd.items() if not k.startswith("head."))


def test_pretrained_falls_back_to_authors_url_when_repo_missing(vit3, hf_cache, tmp_path, monkeypatch):
    """Not uploaded yet (offline, nothing cached): pretrained=True uses the url's cached file."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", "ttt_zoo", "vit3_tiny.in1k.pth")
    os.makedirs(os.path.dirname(cached))
    shutil.copy(vit3["src"], cached)  # what the url download leaves behind
    assert _same_backbone(_tiny_pretrained_vit3(), vit3["sd"])


def test_pretrained_prefers_the_hub_repo_once_it_exists(vit3, hf_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", "ttt_zoo", "vit3_tiny.in1k.pth")
    os.makedirs(os.path.dirname(cached))
    shutil.copy(vit3["src"], cached)
    # a different set of weights on the "hub"
    shifted = {k: v + 1.0 for k, v in vit3["sd"].items()}
    src = _write_official(tmp_path / "shifted.pth", shifted)
    folder = str(tmp_path / "shifted")
    hub.convert_checkpoint(src, "vit3_tiny.in1k", folder, model_args=VIT3_ARGS, flops=False)
    hub.install_to_hub_cache(folder, "ttt-zoo/vit3_tiny.in1k")
    model = _tiny_pretrained_vit3()
    assert _same_backbone(model, shifted) and not _same_backbone(model, vit3["sd"])


# ----- push -----

def test_push_dry_run_validates_and_lists_files(vit3, capsys, no_network, monkeypatch):
    import huggingface_hub

    def forbidden(*a, **k):
        raise AssertionError("dry run must not call the Hub API")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", forbidden)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", forbidden)
    assert cli_main(["push", vit3["folder"], "--source", vit3["src"], "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "outputs match" in out and "would create model repo ttt-zoo/vit3_tiny.in1k" in out
    for f in ("README.md", "config.json", "model.safetensors"):
        size = os.path.getsize(os.path.join(vit3["folder"], f))
        assert re.search(rf"^  {re.escape(f)}  {size:,} bytes  sha256 [0-9a-f]{{64}}$", out, re.M)


def test_push_uploads_with_create_repo_and_upload_folder(vit3, no_network, monkeypatch):
    import huggingface_hub
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **k: calls.append(("create", a, k)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **k: calls.append(("upload", k)))
    hub.push_folder(vit3["folder"], "me/vit3-test", source=vit3["src"], private=True, log=lambda s: None)
    assert calls[0] == ("create", ("me/vit3-test",), dict(repo_type="model", private=True, exist_ok=True))
    assert calls[1][1]["repo_id"] == "me/vit3-test" and calls[1][1]["folder_path"] == vit3["folder"]


def test_push_refuses_other_source_and_changed_weights(vit3, tmp_path, capsys):
    assert cli_main(["push", vit3["folder"], "--dry-run"]) == 2
    assert "Pass --source CKPT" in capsys.readouterr().err
    other = _write_official(tmp_path / "other.pth", {k: v * 2 for k, v in vit3["sd"].items()})
    with pytest.raises(hub.HubFolderError, match=r"is not the checkpoint .* was converted from \(vit3_fixture.pth"):
        hub.validate_folder(vit3["folder"], source=other)
    folder = str(tmp_path / "tampered")
    shutil.copytree(vit3["folder"], folder)
    w = load_file(os.path.join(folder, "model.safetensors"))
    w["head.bias"] = w["head.bias"] + 0.1
    save_file(w, os.path.join(folder, "model.safetensors"))
    with pytest.raises(hub.HubFolderError, match=r"tampered/model.safetensors does not match the sha256 its "
                                                 r"config.json records \('ttt_zoo.weights_sha256'"):
        hub.validate_folder(folder, source=vit3["src"])
    # a config.json that records the changed file's sha256 too: the outputs still differ from the source's
    from ttt_zoo import hub_format
    cfg = hub_format.read_config(folder)
    cfg["ttt_zoo"]["weights_sha256"] = sha256_file(os.path.join(folder, "model.safetensors"))
    hub_format.write_config(folder, cfg)
    with pytest.raises(hub.HubFolderError, match=r"Outputs of .*tampered differ from those of .*vit3_fixture.pth"):
        hub.validate_folder(folder, source=vit3["src"])
    shutil.copy(vit3["src"], os.path.join(folder, "extra.pth"))
    with pytest.raises(hub.HubFolderError, match=r"holds pickle files \['extra.pth'\]"):
        hub.validate_folder(folder, source=vit3["src"])


# ----- bad inputs -----

def test_truncated_and_corrupt_safetensors(vit3, tmp_path):
    folder = str(tmp_path / "trunc")
    shutil.copytree(vit3["folder"], folder)
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    msg = (rf"model.safetensors is truncated or corrupt: its header lists {len(vit3['sd'])} tensors needing {size} bytes "
           rf"but the file holds "
           rf"{size // 2} bytes \({size - size // 2} missing\). Delete it and convert again")
    with pytest.raises(CheckpointError, match=msg):
        hub.validate_folder(folder, source=vit3["src"])
    # timm's own local-dir path raises the same precise error (the header is checked before timm reads the file)
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated or corrupt: its header lists"):
        timm.create_model(f"local-dir:{folder}", pretrained=True)
    with open(path, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match=r"is corrupt: its safetensors header is not valid JSON"):
        hub.load_folder(folder)


def test_truncated_source_checkpoint(vit3, tmp_path):
    bad = tmp_path / "half.pth"
    data = open(vit3["src"], "rb").read()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"Could not read checkpoint .*half.pth.* truncated or corrupt"):
        hub.convert_checkpoint(str(bad), "vit3_tiny.in1k", str(tmp_path / "o"), model_args=VIT3_ARGS)


def test_checkpoint_for_another_architecture(vit3, tmp_path, capsys):
    hvit3_args = json.dumps({"embed_dim": [16, 32, 48, 64], "depths": [1, 1, 1, 1], "num_heads": [1, 2, 2, 2]})
    rc = cli_main(["convert", vit3["src"], "--model", "hvit3_tiny.in1k", "--model-args", hvit3_args,
                   "--out", str(tmp_path / "o"), "--no-flops"])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(r"error: .*vit3_fixture.pth is not a checkpoint for hvit3_tiny.in1k: Checkpoint does not fit "
                     r"model 'hvit3_tiny'\. .*missing keys: \['layers\.0\.", err)
    assert err.rstrip().endswith("Pass the --model (see `ttt-zoo list`) and --model-kwargs K=V (or --model-args JSON) "
                                 "that match the checkpoint.")
    assert "unexpected keys: ['blocks.0." in err
    with pytest.raises(CheckpointError, match=r"shape mismatches \(is it for another model size\?\): "
                                              r"patch_embed.proj.weight: checkpoint \(64, 3, 4, 4\) vs model "
                                              r"\(32, 3, 4, 4\)"):
        hub.convert_checkpoint(vit3["src"], "vit3_tiny.in1k", str(tmp_path / "p"),
                               model_args=dict(VIT3_ARGS, embed_dim=32))
    with pytest.raises(CheckpointError, match=r"Unknown model 'vit4_tiny'"):
        hub.convert_checkpoint(vit3["src"], "vit4_tiny", str(tmp_path / "q"))


def test_missing_config_fields(vit3, tmp_path):
    folder = str(tmp_path / "cfg")
    shutil.copytree(vit3["folder"], folder)
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    del cfg["architecture"]
    del cfg["pretrained_cfg"]["mean"]
    json.dump(cfg, open(path, "w"))
    with pytest.raises(hub.HubFolderError, match=r"config.json is missing required field\(s\) 'architecture', "
                                                 r"'pretrained_cfg.mean'; timm needs them"):
        hub.load_folder(folder)
    del cfg["pretrained_cfg"]
    json.dump(cfg, open(path, "w"))
    with pytest.raises(hub.HubFolderError, match=r"missing required field\(s\) 'architecture', 'pretrained_cfg'"):
        hub.validate_folder(folder, source=vit3["src"])
    os.remove(path)
    with pytest.raises(hub.HubFolderError, match=r"has no config.json"):
        hub.load_folder(folder)


# ----- other layouts -----

def test_official_layouts_ema_dit_and_ours(vit3, tmp_path):
    """H-ViT3 main_ema.py layout: the EMA weights are converted (the fixture sits under 'state_dict_ema', a decoy
    under 'model'); DiT-style {'model','ema','opt','args': Namespace}; a ttt-zoo model.safetensors round trip."""
    import argparse
    tensors, sd, meta, tol = load_fixture("hvit3_model_tiny")
    decoy = {k: v + 1.0 if v.is_floating_point() else v for k, v in sd.items()}
    src = str(tmp_path / "hvit3_ema.pth")
    torch.save({"model": decoy, "state_dict_ema": sd, "epoch": 299, "max_accuracy_e": 84.0}, src)
    args = {"embed_dim": [16, 32, 48, 64], "depths": [1, 1, 1, 1], "num_heads": [1, 2, 2, 2]}
    folder = str(tmp_path / "hvit3")
    hub.convert_checkpoint(src, "hvit3_tiny.in1k", folder, model_args=args, flops=False)
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    torch.testing.assert_close(_logits(model, tensors), tensors["output"], rtol=1e-4, atol=1e-4)
    assert not any(k.endswith("rope.rotations") for k in load_file(os.path.join(folder, "model.safetensors")))

    dit_style = str(tmp_path / "dit_style.pt")
    torch.save({"model": {k: v * 2 for k, v in vit3["sd"].items()}, "ema": vit3["sd"],
                "opt": {"state": {}, "param_groups": []}, "args": argparse.Namespace(model="x", epochs=80)}, dit_style)
    model, _ = hub.build_from_checkpoint("vit3_tiny.in1k", dit_style, VIT3_ARGS)
    torch.testing.assert_close(_logits(model, vit3["tensors"]), vit3["tensors"]["output"], rtol=1e-5, atol=1e-5)

    again = str(tmp_path / "again")
    hub.convert_checkpoint(os.path.join(vit3["folder"], "model.safetensors"), "vit3_tiny.in1k", again,
                           model_args=VIT3_ARGS, flops=False)
    a = load_file(os.path.join(vit3["folder"], "model.safetensors"))
    b = load_file(os.path.join(again, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)



def test_detection_backbone_checkpoint(tmp_path):
    """An mmengine detection checkpoint (backbone.* keys) becomes a hub folder loadable with ttt_zoo.hub."""
    tensors, sd, meta, tol = load_fixture("det_backbone_tiny")
    src = _write_official(tmp_path / "mask_rcnn_fixture.pth", sd, layout="mmengine")
    folder = str(tmp_path / "det")
    args = {"embed_dim": [32, 32, 32, 32], "depths": [1, 1, 1, 1]}
    hub.convert_checkpoint(src, "hvit3_backbone_tiny", folder, model_args=args, flops=False)
    backbone = hub.load_folder(folder).double()
    with torch.no_grad():
        outs = backbone(tensors["input.x"])
    for i, o in enumerate(outs):  # float32-stored weights vs the official float64 run
        torch.testing.assert_close(o, tensors[f"output.{i}"], rtol=1e-5, atol=1e-5)
    meta_card, body = parse_card(open(os.path.join(folder, "README.md")).read())
    assert meta_card["library_name"] == "ttt-zoo" and "load_folder('hf-hub:ttt-zoo/hvit3_backbone_tiny')" in body
    report = hub.validate_folder(folder, source=src)
    assert report["source_checked"] and report["max_abs_diff"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name,paper_gflops,paper_params", [
    ("vit3_tiny", 1.2, 6_149_416), ("vit3_small", 4.8, 23_799_400), ("vit3_base", 18.0, 90_055_912),
    ("hvit3_tiny", 4.9, 28_703_560), ("hvit3_small", 8.8, 54_362_056), ("hvit3_base", 16.7, 94_369_304)])
def test_measured_numbers_match_the_paper(name, paper_gflops, paper_params):
    """What the cards state as 'measured by ttt-zoo' agrees with the paper (GFLOPs rounded to 0.1) and with the
    exact official parameter counts (spec §2, §3)."""
    numbers = hub.measure(timm.create_model(name), (3, 224, 224))
    assert numbers["params"] == paper_params
    assert abs(numbers["macs"] - paper_gflops) <= 0.06 + 0.005 * paper_gflops, numbers


class _TinyDiffusion(torch.nn.Module):
    """Stand-in for a DiT-style model (forward(x, t, y)) until DiT3 lands, to exercise the generic diffusion path."""

    def __init__(self, in_chans: int = 4, num_classes: int = 10, dim: int = 8):
        super().__init__()
        self.in_chans, self.num_classes = in_chans, num_classes
        self.proj = torch.nn.Conv2d(in_chans, dim, 1)
        self.y_embedder = torch.nn.Embedding(num_classes + 1, dim)
        self.out = torch.nn.Conv2d(dim, 2 * in_chans, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + self.y_embedder(y)[:, :, None, None] + t[:, None, None, None].float() / 1000
        return self.out(torch.nn.functional.silu(h))


def test_generic_diffusion_model_path(tmp_path, monkeypatch):
    """A registered model with forward(x, t, y) and a DiT checkpoint layout converts, measures and validates."""
    import argparse
    import ttt_zoo.models
    from timm.models import generate_default_cfgs, register_model
    from ttt_zoo.models._common import build_ttt_model
    if "tiny_diffusion_for_hub_test" not in timm.list_models():
        default_cfgs = generate_default_cfgs({"tiny_diffusion_for_hub_test.in1k_256": {
            "url": "", "input_size": (4, 8, 8), "num_classes": 10, "mean": (0.0,) * 4, "std": (1.0,) * 4,
            "license": "apache-2.0", "paper_ids": "arXiv:2512.01643", "classifier": None}})
        globals()["default_cfgs"] = default_cfgs

        def tiny_diffusion_for_hub_test(pretrained=False, **kwargs):
            return build_ttt_model(_TinyDiffusion, "tiny_diffusion_for_hub_test", pretrained, **kwargs)
        tiny_diffusion_for_hub_test.__module__ = __name__
        register_model(tiny_diffusion_for_hub_test)
    monkeypatch.setattr(ttt_zoo.models, "MODEL_MODULES", ttt_zoo.models.MODEL_MODULES + (__name__.split(".")[-1],))
    ref = _TinyDiffusion()
    src = str(tmp_path / "dit.pt")
    torch.save({"model": {k: v * 0 for k, v in ref.state_dict().items()}, "ema": ref.state_dict(),
                "opt": {"state": {}, "param_groups": []}, "args": argparse.Namespace(image_size=256)}, src)
    folder = str(tmp_path / "dit")
    info = hub.convert_checkpoint(src, "tiny_diffusion_for_hub_test.in1k_256", folder)
    assert info["kind"] == "diffusion" and info["macs_input"] == [4, 8, 8]
    # MACs of the two 1x1 convs on an 8x8 map: 64 * (4*8 + 8*8)
    assert info["macs"] * 1e9 == pytest.approx(64 * (4 * 8 + 8 * 8))
    meta, body = parse_card(open(os.path.join(folder, "README.md")).read())
    assert "class-conditional-image-generation" in meta["tags"] and "image-classification" not in meta["tags"]
    report = hub.validate_folder(folder, source=src)
    assert report["source_checked"] and report["max_abs_diff"] == 0.0


# ----- convert never loses an existing folder; bad output paths fail before any work -----

_SLOW_WRITE = """
import os, sys, time
import safetensors.torch as st

def stalled_save_file(tensors, filename, metadata=None):  # half a file, then wait to be killed
    with open(filename, "wb") as f:
        f.write(b"partial weights")
    open(os.environ["READY"], "w").close()
    time.sleep(600)

st.save_file = stalled_save_file
from ttt_zoo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _tiny_vit3_checkpoint(path, seed):
    torch.manual_seed(seed)
    torch.save({"model": timm.create_model("vit3_tiny", **VIT3_ARGS).state_dict()}, path)
    return str(path)


def test_convert_force_killed_mid_write_keeps_the_old_folder(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    out = str(tmp_path / "hub" / "vit3_tiny.in1k")
    old_src = _tiny_vit3_checkpoint(tmp_path / "old.pth", 0)
    hub.convert_checkpoint(old_src, "vit3_tiny.in1k", out, model_args=VIT3_ARGS, flops=False)
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    assert set(before) == {"model.safetensors", "config.json", "README.md"}

    new_src = _tiny_vit3_checkpoint(tmp_path / "new.pth", 1)
    ready = str(tmp_path / "ready")
    args = ["convert", new_src, "--model", "vit3_tiny.in1k", "--model-args", json.dumps(VIT3_ARGS), "--out", out,
            "--force", "--no-flops"]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, READY=ready)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        while not os.path.exists(ready):  # a hang is caught by pytest-timeout (pyproject.toml), not a deadline here
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    after = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    assert after == before  # the old folder is complete and untouched
    model = hub.load_folder(out)
    for k, v in torch.load(old_src)["model"].items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)

    # the next --force conversion completes, replaces the files, keeps other files, clears the killed run's folder
    with open(os.path.join(out, ".gitattributes"), "w") as f:
        f.write("*.safetensors filter=lfs\n")
    assert cli_main(args) == 0
    model = hub.load_folder(out)
    for k, v in torch.load(new_src)["model"].items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=0)
    assert sorted(os.listdir(out)) == [".gitattributes", "README.md", "config.json", "model.safetensors"]
    assert os.listdir(os.path.dirname(out)) == ["vit3_tiny.in1k"]


def test_convert_to_a_file_or_read_only_folder_fails_first(tmp_path, capsys):
    """The output path is checked first: the checkpoint 'missing.pth' (which would fail next) is never read."""
    afile = tmp_path / "out.txt"
    afile.write_text("keep me")
    assert cli_main(["convert", "missing.pth", "--model", "vit3_tiny.in1k", "--out", str(afile)]) == 2
    assert f"The output path {afile} is a file; give a folder path" in capsys.readouterr().err
    assert afile.read_text() == "keep me"

    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        targets = [(str(ro / "sub"), "Cannot write the output folder"), (str(ro), "is read-only")]
    else:  # root ignores permission bits: use a folder the kernel refuses to write
        targets = [("/proc/ttt_zoo_out/x", "Cannot write the output folder")]
    for out, msg in targets:
        assert cli_main(["convert", "missing.pth", "--model", "vit3_tiny.in1k", "--out", out, "--force"]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
