"""``ttt-zoo predict``: top-k against a direct forward of the same model on timm's eval transform, for a file, a
folder and a glob; csv / json columns as timm's inference.py; class names (class map, training folder, Hub folder,
ImageNet); one-line errors; no results file overwritten without --force."""

import csv
import json
import os

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file
from timm.data import ImageNetInfo, create_transform, resolve_data_config

import ttt_zoo  # noqa: F401
from ttt_zoo.cli import main

MODEL, KW = "vit3_tiny", dict(depth=1, embed_dim=32, num_heads=2, patch_size=4, img_size=16)
FLAGS = ["--model", MODEL, "--model-kwargs", "depth=1", "embed_dim=32", "num_heads=2", "patch_size=4",
         "--img-size", "16", "-j", "0", "-b", "2", "--device", "cpu"]


def _model(num_classes=3, seed=123):
    torch.manual_seed(seed)
    return timm.create_model(MODEL, num_classes=num_classes, **KW).eval()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Images (non-square, so timm's resize and crop matter; one in a subfolder), 3-class and 1000-class weights."""
    root = tmp_path_factory.mktemp("predict")
    rng = np.random.default_rng(0)
    os.makedirs(root / "imgs" / "sub")
    for name, size in (("a.png", (20, 24)), ("b.jpg", (30, 18)), ("sub/c.png", (16, 16))):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / "imgs" / name)
    save_file(_model().state_dict(), str(root / "w.safetensors"))
    save_file(_model(1000).state_dict(), str(root / "in1k.safetensors"))
    return dict(root=str(root), imgs=str(root / "imgs"), w=str(root / "w.safetensors"),
                in1k=str(root / "in1k.safetensors"))


def _reference(model, paths, k):
    """Top-k (indices, probabilities) of a direct forward on timm's eval transform of the model's data config at
    16 px (the constructor's img_size does not change the pretrained cfg's 224)."""
    transform = create_transform(**resolve_data_config(dict(img_size=16), model=model))
    x = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
    with torch.no_grad():
        prob, idx = model(x).softmax(-1).topk(k)
    return idx.tolist(), prob.tolist()


def _predict(capsys, *argv):
    """(exit status, the stdout JSON or None, stderr)."""
    try:
        rc = main(["predict", *map(str, argv)])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 and out.strip() else None, err


def _one_error(rc, err, phrase):
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0] and ";" in lines[0], err


@pytest.mark.parametrize("source,names", [("a.png", ["a.png"]), (".", ["a.png", "b.jpg", "c.png"]),
                                          ("*.*", ["a.png", "b.jpg"]), ("**/*.png", ["a.png", "c.png"])])
def test_topk_matches_a_direct_forward(env, capsys, source, names):
    paths = {os.path.basename(p): p for p in (os.path.join(env["imgs"], n) for n in ("a.png", "b.jpg", "sub/c.png"))}
    want_idx, want_prob = _reference(_model(), [paths[n] for n in names], 2)
    src = env["imgs"] if source == "." else os.path.join(env["imgs"], source)
    rc, got, err = _predict(capsys, src, *FLAGS, "--checkpoint", env["w"], "--topk", "2")
    assert rc == 0, err
    assert list(got) == names  # timm's json: {filename: {column: value}}, in timm's natural order
    assert [got[n]["index"] for n in names] == want_idx  # no class names: the index column names the classes
    for n, prob in zip(names, want_prob):
        assert got[n]["prob"] == pytest.approx(prob, abs=1e-6)
    assert "no class names" in err
    # the checkpoint decides: other weights give other probabilities
    assert _reference(_model(seed=0), [paths[names[0]]], 2)[1][0] != pytest.approx(want_prob[0], abs=1e-6)


def test_csv_and_json_results(env, tmp_path, capsys):
    names = ["a.png", "b.jpg", "c.png"]
    paths = [os.path.join(env["imgs"], n) for n in ("a.png", "b.jpg", "sub/c.png")]
    want_idx, want_prob = _reference(_model(), paths, 3)
    class_map = tmp_path / "classes.txt"
    class_map.write_text("cat\ndog\nbird\n")
    base = [env["imgs"], *FLAGS, "--checkpoint", env["w"], "--class-map", class_map, "--label-type", "name"]

    out = tmp_path / "top1.csv"  # top-1: one column each (timm: filename, index, label, prob)
    assert _predict(capsys, *base, "--include-index", "--results-file", out)[0] == 0
    rows = list(csv.DictReader(open(out)))
    assert list(rows[0]) == ["filename", "index", "label", "prob"]
    assert [r["filename"] for r in rows] == names
    assert [int(r["index"]) for r in rows] == [i[0] for i in want_idx]
    assert [r["label"] for r in rows] == [["cat", "dog", "bird"][i[0]] for i in want_idx]
    assert [float(r["prob"]) for r in rows] == pytest.approx([p[0] for p in want_prob], abs=1e-6)

    out = tmp_path / "top3.csv"  # top-k in a csv: timm's separate columns
    assert _predict(capsys, *base, "--topk", "3", "--results-file", out, "--no-console-results")[0] == 0
    rows = list(csv.DictReader(open(out)))
    assert list(rows[0]) == ["filename", "label_0", "label_1", "label_2", "prob_0", "prob_1", "prob_2"]
    assert [float(rows[1][f"prob_{j}"]) for j in range(3)] == pytest.approx(want_prob[1], abs=1e-6)

    out = tmp_path / "top3"  # no extension: --results-format picks it, as in timm
    rc, printed, err = _predict(capsys, *base, "--topk", "3", "--results-file", out, "--results-format", "json")
    assert rc == 0, err
    got = json.load(open(f"{out}.json"))
    assert got == printed and list(got) == names
    assert got["b.jpg"]["label"] == [["cat", "dog", "bird"][i] for i in want_idx[1]]
    assert got["b.jpg"]["prob"] == pytest.approx(want_prob[1], abs=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["classes.txt", "top1.csv", "top3.csv", "top3.json"]  # no temporaries

    # an existing results file is refused without --force, kept, and replaced with it
    before = open(tmp_path / "top1.csv").read()
    rc, _, err = _predict(capsys, *base, "--topk", "2", "--results-file", tmp_path / "top1.csv")
    _one_error(rc, err, "add --force")
    assert open(tmp_path / "top1.csv").read() == before
    assert _predict(capsys, *base, "--topk", "2", "--results-file", tmp_path / "top1.csv", "--force")[0] == 0
    assert list(next(csv.DictReader(open(tmp_path / "top1.csv")))) == ["filename", "label_0", "label_1", "prob_0",
                                                                        "prob_1"]


def test_label_names_of_runs_hub_folders_and_imagenet(env, tmp_path, capsys):
    img = os.path.join(env["imgs"], "a.png")
    ((idx,),), ((prob,),) = _reference(_model(), [img], 1)
    # a `ttt-zoo train` folder: args.yaml gives the model and the data, whose class folders name the classes
    for c in ("cat", "dog", "bird"):
        os.makedirs(tmp_path / "data" / "train" / c)
    run = tmp_path / "run"
    run.mkdir()
    save_file(_model().state_dict(), str(run / "best.safetensors"))
    (run / "args.yaml").write_text(yaml.safe_dump(dict(
        model=MODEL, model_kwargs={k: v for k, v in KW.items() if k != "img_size"}, img_size=16, num_classes=3,
        data_dir=str(tmp_path / "data"), train_split="train")))
    rc, got, err = _predict(capsys, img, "--checkpoint", run, "-j", "0", "--label-type", "name")
    assert rc == 0, err
    assert got["a.png"]["label"] == ["bird", "cat", "dog"][idx] and "class folders" in err

    # a Hub folder whose config.json has label_names (and descriptions: --label-type description)
    from timm.models import save_for_hf
    hub = tmp_path / "hub"
    save_for_hf(_model(), str(hub), safe_serialization=True, model_args={k: v for k, v in KW.items()},
                model_config=dict(label_names=["n1", "n2", "n3"],
                                  label_descriptions={"n1": "one", "n2": "two", "n3": "three"}))
    rc, got, err = _predict(capsys, img, "--checkpoint", hub, "-j", "0", "--img-size", "16", "--include-index")
    assert rc == 0, err
    assert got["a.png"] == dict(index=idx, label=["one", "two", "three"][idx], prob=pytest.approx(prob, abs=1e-6))

    # 1000 classes: timm's ImageNetInfo (names are synsets; detail adds the definition)
    ((idx,),), _ = _reference(_model(1000), [img], 1)
    info = ImageNetInfo()
    for label_type, want in (("name", info.index_to_label_name(idx)), ("description", info.index_to_description(idx)),
                             ("detail", info.index_to_description(idx, detailed=True))):
        rc, got, err = _predict(capsys, img, *FLAGS, "--checkpoint", env["in1k"], "--label-type", label_type)
        assert rc == 0, err
        assert got["a.png"]["label"] == want


def test_bad_inputs_are_one_line(env, tmp_path, capsys):
    base = [*FLAGS, "--checkpoint", env["w"]]
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.png").write_bytes(b"not a png")
    os.makedirs(tmp_path / "twice" / "x")
    for folder in ("twice", "twice/x"):
        Image.new("RGB", (16, 16)).save(tmp_path / folder / "same.png")
    for argv, phrase in [
        ([tmp_path / "empty", *base], "no image matched"),
        ([tmp_path / "*.jpg", *base], "no image matched"),
        ([tmp_path / "nope.png", *base], "does not exist"),
        ([*base], "no images given"),
        ([tmp_path / "broken.png", *base], "cannot read 1 of 1 image(s)"),
        ([env["imgs"], *FLAGS, "--checkpoint", tmp_path / "missing.safetensors"], "--checkpoint"),
        ([env["imgs"], *FLAGS, "--checkpoint", tmp_path / "empty"], "without args.yaml"),
        ([env["imgs"], *base, "--results-file", tmp_path / "r.txt"], ".csv or .json"),
        ([env["imgs"], *base, "--results-format", "parquet", "--results-dir", tmp_path], "parquet"),
        ([env["imgs"], *base, "--topk", "0"], "--topk"),
        ([tmp_path / "twice", *base], "--fullname"),
        ([env["imgs"], "--model", "vit3_tinyy", "--checkpoint", env["w"]], "not a registered model"),
    ]:
        rc, _, err = _predict(capsys, *argv)
        _one_error(rc, err, phrase)
    assert sorted(os.listdir(tmp_path)) == ["broken.png", "empty", "twice"]  # nothing written
    rc, got, err = _predict(capsys, tmp_path / "twice", *base, "--fullname")
    assert rc == 0 and sorted(got) == sorted(str(p) for p in (tmp_path / "twice" / "same.png",
                                                               tmp_path / "twice" / "x" / "same.png")), err


def test_progress_on_stderr_past_the_delay(env, capsys, monkeypatch):
    """Past the progress delay (set, not waited for) predict prints lines at its first and last batch (3 images,
    -b 2) on stderr, so the JSON on stdout stays whole; under it, none."""
    import ttt_zoo.progress
    monkeypatch.setattr(ttt_zoo.progress, "DEFAULT_DELAY", 0.0)
    rc, got, err = _predict(capsys, env["imgs"], *FLAGS, "--checkpoint", env["w"])
    assert rc == 0 and list(got) == ["a.png", "b.jpg", "c.png"], err
    lines = [line for line in err.splitlines() if line.startswith("predict [")]
    assert [line.split(" eta ")[0] for line in lines] == ["predict [1/2]", "predict [2/2]"], err
    assert all(" img/s " in line for line in lines)
    monkeypatch.setattr(ttt_zoo.progress, "DEFAULT_DELAY", 1e9)
    rc, got, err = _predict(capsys, env["imgs"], *FLAGS, "--checkpoint", env["w"])
    assert rc == 0 and list(got) == ["a.png", "b.jpg", "c.png"] and "predict [" not in err
