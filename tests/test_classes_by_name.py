"""Classes by name, everywhere (issue 45 item 3): the run records its class names once (``task.class_names``, in
label order); ``validate`` labels the class folders by those names (a subset is fine, an unknown class is refused,
naming it); ``predict`` and ``convert`` (config.json's ``label_names``, the card) use the recorded names; empty class
folders, stray entries and symlink loops are refused before training starts."""
import json
import os
import shutil

import pytest
import torch

from _train_data import make_tiny_digits
from test_cli_errors import cli

from ttt_zoo import run_folder
from ttt_zoo.train.classification import class_folders, scan_folder
from ttt_zoo.train.validate import eval_dataset, eval_loader, validate

KW = ["depth=1", "embed_dim=16", "num_heads=2", "patch_size=4"]
FLAGS = ["--img-size", "16", "--workers", "0", "--opt", "sgd", "--lr", "0.05", "--warmup-epochs", "0", "-b", "8",
         "--log-interval", "100", "--device", "cpu"]
VIT3 = ["--model", "vit3_tiny", "--model-kwargs", *KW, *FLAGS]
#: class folder names: not the digits, so that a name and an index cannot be mistaken for each other
NAMES = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "ibis", "jay"]


def _named_digits(root):
    """make_tiny_digits with class folders ant .. jay (4 train, 2 val images each)."""
    make_tiny_digits(root)
    for split in ("train", "val"):
        for i, name in enumerate(NAMES):
            os.rename(os.path.join(root, split, str(i)), os.path.join(root, split, name))
    return root


def _copy(src, dst, drop=(), rename=None):
    """A copy of the data folder ``src`` without the val/ classes ``drop``, with val/ classes renamed by ``rename``."""
    shutil.copytree(src, dst)
    for name in drop:
        shutil.rmtree(os.path.join(dst, "val", name))
    for old, new in (rename or {}).items():
        os.rename(os.path.join(dst, "val", old), os.path.join(dst, "val", new))
    return str(dst)


def _train(capsys, data, out, name):
    return cli(capsys, "train", "--data-dir", data, "--output", out, *VIT3, "--experiment", name, "--epochs", 1)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("classes")
    data = _named_digits(str(root / "data"))
    return {"root": root, "data": data}


@pytest.fixture(scope="module")
def run(env):
    """A finished 1-epoch run on the named data."""
    from ttt_zoo.cli import main
    assert main(["train", "--data-dir", env["data"], "--output", str(env["root"] / "runs"), *VIT3, "--experiment",
                 "run", "--epochs", "1"]) == 0
    return str(env["root"] / "runs" / "run")


def _first_error(err):
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----- the record -----

def test_run_records_class_names_in_label_order(run, env):
    rec = run_folder.read_record(run)
    assert rec["class_names"] == NAMES and rec["num_classes"] == 10
    assert run_folder.resolve_checkpoint(run).class_names == NAMES
    assert run_folder.resolve_checkpoint(os.path.join(run, "best.safetensors")).class_names == NAMES


# ----- validate: by name -----

def _labels(dataset):
    """{file name: label} of a timm folder data set."""
    return {os.path.basename(dataset.filename(i)): int(dataset[i][1]) for i in range(len(dataset))}


def test_validation_folder_lacking_a_class_keeps_every_label(env, tmp_path):
    lack = _copy(env["data"], tmp_path / "lack", drop=["ant"])
    full = _labels(eval_dataset(env["data"], "validation", NAMES))
    part = _labels(eval_dataset(lack, "validation", NAMES))
    assert len(part) == len(full) - 2 and part == {k: v for k, v in full.items() if k in part}
    assert set(part.values()) == set(range(1, 10))  # ant (0) is missing, nothing shifted into its place
    # by position (a plain weights file, no names): every label after the missing class moves down by one
    shifted = _labels(eval_dataset(lack, "validation"))
    assert all(shifted[k] == v - 1 for k, v in part.items())


def _top1_by_name(run, folder):
    """Top-1 of the run's best weights on ``folder``/val, each image's truth being its folder's name."""
    import timm
    from safetensors.torch import load_file
    model = timm.create_model("vit3_tiny", depth=1, embed_dim=16, num_heads=2, patch_size=4, img_size=16,
                              num_classes=10)
    model.load_state_dict(load_file(os.path.join(run, "best.safetensors")))
    dataset = eval_dataset(folder, "validation")  # labels unused: the truth is the folder name
    loader, _ = eval_loader(dataset, model.eval(), batch_size=64, img_size=16, workers=0)
    with torch.no_grad():
        pred = torch.cat([model(x).argmax(-1) for x, _ in loader]).tolist()
    truth = [NAMES.index(os.path.basename(os.path.dirname(dataset.filename(i)))) for i in range(len(dataset))]
    return 100.0 * sum(p == t for p, t in zip(pred, truth)) / len(truth)


def test_validate_a_subset_of_classes_by_name(run, env, tmp_path, capsys):
    lack = _copy(env["data"], tmp_path / "lack", drop=["ant", "eel"])
    rows = validate("vit3_tiny", lack, checkpoint=os.path.join(run, "best.safetensors"), img_size=16,
                    model_kwargs=dict(depth=1, embed_dim=16, num_heads=2, patch_size=4), workers=0, device="cpu",
                    class_names=NAMES)
    assert rows[0]["top1"] == pytest.approx(_top1_by_name(run, lack), abs=1e-3)
    rc, err = cli(capsys, "validate", "--checkpoint", run, "--data-dir", lack, "-j", 0, "--device", "cpu",
                  "--results-file", tmp_path / "r.json")
    assert rc == 0, err
    got = json.loads((tmp_path / "r.json").read_text())
    assert got[0]["top1"] == pytest.approx(_top1_by_name(run, lack), abs=1e-3)


def test_validate_refuses_an_unknown_class_naming_it(run, env, tmp_path, capsys):
    other = _copy(env["data"], tmp_path / "other", rename={"jay": "kiwi"})
    rc, err = cli(capsys, "validate", "--checkpoint", run, "--data-dir", other, "-j", 0, "--device", "cpu")
    line = _first_error(err)
    assert rc == 2 and "kiwi" in line and "jay" not in line.split("kiwi")[0], line


def test_plain_weights_file_by_position_says_so(run, env, tmp_path, capsys):
    lack = _copy(env["data"], tmp_path / "lack", drop=["ant"])
    plain = tmp_path / "plain.safetensors"
    shutil.copy(os.path.join(run, "best.safetensors"), plain)  # outside a run: no names
    base = ["validate", "--checkpoint", plain, "--model", "vit3_tiny", "--model-kwargs", *KW, "--img-size", 16,
            "--num-classes", 10, "-j", 0, "--device", "cpu", "--data-dir"]
    rc, err = cli(capsys, *base, lack)
    assert rc == 0 and "9 class folders and the model 10 classes" in err and "by position" in err, err
    rc, err = cli(capsys, *base, env["data"])
    assert rc == 0 and "by position" not in err, err


# ----- training: refused before it starts -----

def _broken(env, tmp_path, how):
    data = _copy(env["data"], tmp_path / how)
    train = os.path.join(data, "train")
    if how == "empty":
        for f in os.listdir(os.path.join(train, "cat")):
            os.remove(os.path.join(train, "cat", f))
        return data, "cat/ (no image files)"
    if how == "stray_folder":
        os.makedirs(os.path.join(train, "notes", "drafts"))
        return data, "notes/ (no image files)"
    if how == "stray_file":
        with open(os.path.join(train, "README.txt"), "w") as f:
            f.write("digits\n")
        return data, "README.txt (not a folder)"
    if how == "loose_image":
        shutil.copy(os.path.join(train, "ant", sorted(os.listdir(os.path.join(train, "ant")))[0]),
                    os.path.join(train, "x.png"))
        return data, "x.png (an image outside a class folder)"
    if how == "nested":
        os.makedirs(os.path.join(train, "bee", "more"))
        for f in os.listdir(os.path.join(train, "cat")):
            shutil.copy(os.path.join(train, "cat", f), os.path.join(train, "bee", "more", f))
        return data, "bee/more/"
    if how == "loop":
        os.symlink("..", os.path.join(train, "dog", "up"))
        return data, "is a symlink to"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["empty", "stray_folder", "stray_file", "loose_image", "nested", "loop"])
def test_bad_class_folders_refused_before_training(env, tmp_path, capsys, how):
    data, named = _broken(env, tmp_path, how)
    rc, err = _train(capsys, data, tmp_path / "runs", "x")
    line = _first_error(err)
    assert rc == 2 and named in line, line
    assert "epoch" not in err  # nothing trained
    assert not os.path.exists(tmp_path / "runs" / "x" / "checkpoint.json")


def test_scan_of_a_split():
    """class_folders: timm's order (natural sort), strict only for training data."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for c in ("c10", "c2", "empty"):
            os.makedirs(os.path.join(d, c))
        for c in ("c10", "c2"):
            open(os.path.join(d, c, "a.png"), "wb").close()
        open(os.path.join(d, "notes.txt"), "w").close()
        scan = scan_folder(d)
        assert (scan.classes, scan.empty, scan.stray) == (["c2", "c10"], ["empty"], ["notes.txt"])
        assert class_folders(d, strict=False) == ["c2", "c10"]
        with pytest.raises(ValueError, match=r"2 entries that are not class folders.*empty/ \(no image files\), "
                                             r"notes\.txt \(not a folder\)"):
            class_folders(d)


def test_eval_split_by_name_during_training(env, tmp_path, capsys):
    """The training run's own evaluation labels val/ by name: a missing class is fine, an unknown one refused."""
    lack = _copy(env["data"], tmp_path / "lack", drop=["ant"])
    import argparse
    from ttt_zoo.train.classification import ClassificationTask
    from ttt_zoo.train.task_flags import add_task_args
    p = argparse.ArgumentParser()
    add_task_args(p, "classification")
    p.add_argument("--data-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-b", "--batch-size", type=int, default=8)
    p.add_argument("--validation-batch-size", type=int, default=None)
    args = p.parse_args(["--data-dir", lack])
    task = ClassificationTask(args, None)
    train_ds, eval_ds = task._datasets()
    assert task.class_names == NAMES
    assert _labels(eval_ds) == {k: v for k, v in _labels(eval_dataset(env["data"], "validation", NAMES)).items()
                                if k in _labels(eval_ds)}
    other = _copy(env["data"], tmp_path / "other", rename={"jay": "kiwi"})
    rc, err = _train(capsys, other, tmp_path / "runs", "x")
    line = _first_error(err)
    assert rc == 2 and "kiwi" in line, line


# ----- predict: the recorded names -----

def test_predict_labels_with_recorded_names_when_the_data_changed(env, tmp_path, capsys):
    data = _copy(env["data"], tmp_path / "moving")
    rc, err = _train(capsys, data, tmp_path / "runs", "p")
    assert rc == 0, err
    run = tmp_path / "runs" / "p"
    shutil.rmtree(os.path.join(data, "train", "ant"))  # the data folder changed after training: names shift
    os.rename(os.path.join(data, "train", "jay"), os.path.join(data, "train", "zebra"))
    rc, err = cli(capsys, "predict", os.path.join(env["data"], "val"), "--checkpoint", run, "--device", "cpu",
                  "--include-index", "--topk", 3, "--label-type", "name", "--results-file", tmp_path / "p.json")
    assert rc == 0, err
    got = json.loads((tmp_path / "p.json").read_text())
    assert len(got) == 20 and "recorded" in err
    for row in got.values():
        assert row["label"] == [NAMES[i] for i in row["index"]]


# ----- convert: label_names, the card, and back -----

def test_convert_writes_label_names_and_they_round_trip(run, env, tmp_path, capsys):
    import timm
    from ttt_zoo.hub import load_folder
    hub = tmp_path / "hub"
    rc, err = cli(capsys, "convert", os.path.join(run, "best.safetensors"), "--model", "vit3_tiny.named", "--out",
                  hub, "--no-flops")
    assert rc == 0, err
    cfg = json.loads((hub / "config.json").read_text())
    assert cfg["label_names"] == NAMES and cfg["num_classes"] == 10
    card = (hub / "README.md").read_text()
    assert "`ant`, `bee`" in card and "`jay`" in card
    assert load_folder(str(hub)).pretrained_cfg["label_names"] == NAMES
    assert timm.create_model(f"local-dir:{hub}", pretrained=True).pretrained_cfg["label_names"] == NAMES
    # predict with the Hub folder labels with the names, as with the run
    rc, err = cli(capsys, "predict", os.path.join(env["data"], "val"), "--checkpoint", hub, "--device", "cpu",
                  "--include-index", "--label-type", "name", "--results-file", tmp_path / "h.json")
    assert rc == 0, err
    rows = json.loads((tmp_path / "h.json").read_text())
    rc, err = cli(capsys, "predict", os.path.join(env["data"], "val"), "--checkpoint", run, "--device", "cpu",
                  "--include-index", "--label-type", "name", "--results-file", tmp_path / "r.json")
    assert rc == 0, err
    assert rows == json.loads((tmp_path / "r.json").read_text())
    assert all(r["label"] == NAMES[r["index"]] for r in rows.values())
    # validate with the Hub folder: its label_names label the folders by name too
    other = _copy(env["data"], tmp_path / "other", rename={"jay": "kiwi"})
    rc, err = cli(capsys, "validate", "--checkpoint", hub, "--model", "vit3_tiny", "--model-kwargs", *KW,
                  "--img-size", 16, "--data-dir", other, "-j", 0, "--device", "cpu")
    assert rc == 2 and "kiwi" in _first_error(err)


def test_a_missing_split_is_said(run, env, tmp_path, capsys):
    """No such split: timm falls back to the data folder itself, whose subfolders are splits, not classes."""
    rc, err = cli(capsys, "validate", "--checkpoint", run, "--data-dir", env["data"], "--split", "test", "-j", 0,
                  "--device", "cpu")
    assert rc == 2 and "has no 'test' folder" in _first_error(err)
    rc, err = cli(capsys, "train", "--data-dir", env["data"], "--train-split", "trn", "--output", tmp_path / "runs",
                  *VIT3, "--experiment", "x", "--epochs", 1)
    assert rc == 2 and "has no 'trn' folder" in _first_error(err)
