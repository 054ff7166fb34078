"""The run folder's one owner (ttt_zoo.run_folder): a resume never moves a run backwards, every command that reads
a run's weights checks checkpoint.json's sha256, a run folder works wherever a checkpoint is accepted, and the
recorded arguments are merged across resumes.

The run: the setup of test_epoch_commit (--lr 0.5: epoch 1 best, epoch 2 not), stopped after 2 of 3 epochs, so
that best.* (epoch 1) is older than the latest commit (epoch 2)."""
import os
import shutil

import pytest

from _train_data import make_tiny_digits
from test_cli_errors import cli
from test_epoch_commit import TINY

from ttt_zoo import run_folder
from ttt_zoo.cli.demo import ASSET_IMAGE
from ttt_zoo.fileio import sha256_file


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_folder")
    data = make_tiny_digits(str(root / "digits"))
    from ttt_zoo.cli import main
    assert main(["train", "--data-dir", data, "--output", str(root / "runs"), *TINY, "--experiment", "r",
                 "--stop-after", "2"]) == 0
    folder = root / "runs" / "r"
    manifest = run_folder.read_manifest(str(folder))
    assert (manifest["epoch"], manifest["best_epoch"]) == (2, 0), "best.* must be older than the latest commit"
    return {"root": root, "data": data, "folder": folder}


@pytest.fixture
def run(env, tmp_path):
    folder = tmp_path / "r"
    shutil.copytree(env["folder"], folder)
    return folder


def _contents(folder):
    """name -> sha256 of every file in the folder (what "byte-identical" means)."""
    return {n: sha256_file(os.path.join(folder, n)) for n in sorted(os.listdir(folder))}


def _one_error_line(rc, err):
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err[-3000:])
    return lines[0]


# ----- 1. a resume never moves a run backwards -----

@pytest.mark.parametrize("given", ["best.state.pt", "best.safetensors"])
def test_resume_of_best_older_than_the_latest_commit_is_refused_and_changes_nothing(env, run, capsys, given):
    before = _contents(run)
    rc, err = cli(capsys, "train", "--data-dir", env["data"], "--output", run.parent, *TINY,
                  "--resume", run / given)
    line = _one_error_line(rc, err)
    assert f"--resume {run / given}: that is epoch 1 of the run, but {run} has committed epoch 2" in line
    assert f"continue the run: `ttt-zoo train --resume {run}`" in line
    assert f"`ttt-zoo train ... --initial-checkpoint {run / 'best.safetensors'} --experiment NEW`" in line
    assert _contents(run) == before  # every file byte-identical, no file added (not even a lock) or removed


def test_resume_of_the_run_continues_from_the_latest_commit(env, run):
    rows_before = (run / "summary.csv").read_text().splitlines()
    from ttt_zoo.train.trainer import main
    main(["--data-dir", env["data"], "--output", str(run.parent), *TINY, "--resume", str(run)])
    assert run_folder.read_manifest(str(run))["epoch"] == 3
    assert (run / "summary.csv").read_text().splitlines()[:3] == rows_before  # the committed rows are kept


# ----- 6. every reader of a run's weights checks checkpoint.json's sha256 -----

def _flip_a_data_byte(path):
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    raw[8 + header + (len(raw) - 8 - header) // 2] ^= 0x01  # a weight's byte: the header still parses
    path.write_bytes(bytes(raw))


def _image(data):
    return os.path.join(data, "val", "3", sorted(os.listdir(os.path.join(data, "val", "3")))[0])


def _readers(env, run, tmp_path):
    best, data = run / "best.safetensors", env["data"]
    image = _image(data)
    kwargs = ["--model-kwargs", "depth=1", "embed_dim=16", "num_heads=2", "patch_size=4", "img_size=16"]
    return {
        "validate": ["validate", "--checkpoint", best, "--workers", 0, "--device", "cpu"],
        "predict": ["predict", image, "--checkpoint", best, "--workers", 0, "--device", "cpu"],
        # sample reads the file through the same resolver before it looks at the model (a classifier's file here)
        "sample": ["sample", "--checkpoint", best, "--model", "dit_s_2", "--out", tmp_path / "s.png"],
        "attention-map": ["attention-map", "--model", "vit3_tiny", *kwargs, "--checkpoint", best, "--query-pixel",
                          4, 4, "--image", image, "--out", tmp_path / "a.png"],
        "export": ["export", "--model", "vit3_tiny", *kwargs, "--checkpoint", best, "--out", tmp_path / "m.onnx"],
        "convert": ["convert", best, "--model", "vit3_tiny.digits", *kwargs, "--out", tmp_path / "hub",
                    "--no-flops"],
        "train --initial-checkpoint": ["train", "--data-dir", data, "--output", tmp_path / "runs", *TINY,
                                       "--initial-checkpoint", best, "--experiment", "new"],
    }


@pytest.mark.parametrize("command", ["validate", "predict", "sample", "attention-map", "export", "convert",
                                     "train --initial-checkpoint"])
def test_every_reader_refuses_a_run_file_that_differs_from_its_commit(env, run, tmp_path, capsys, command):
    _flip_a_data_byte(run / "best.safetensors")
    before = _contents(run)
    rc, err = cli(capsys, *_readers(env, run, tmp_path)[command])
    line = _one_error_line(rc, err)
    assert f"{run / 'best.safetensors'} is missing or differs from what {run / 'checkpoint.json'} committed" in line
    assert "corrupted or changed" in line
    assert _contents(run) == before
    assert not {"s.png", "a.png", "m.onnx", "hub", "runs"} & set(os.listdir(tmp_path))  # nothing was written


# ----- 8. a run folder is accepted wherever a checkpoint is -----

def test_attention_map_and_convert_take_a_run_folder(env, run, tmp_path, capsys):
    image = _image(env["data"])
    rc, err = cli(capsys, "attention-map", "--model", "vit3_tiny", "--checkpoint", run, "--query-pixel", 4, 4,
                  "--image", image, "--out", tmp_path / "a.png")
    assert rc == 0 and (tmp_path / "a.png").is_file(), err[-3000:]
    rc, err = cli(capsys, "convert", run, "--model", "vit3_tiny.digits", "--out", tmp_path / "hub", "--no-flops")
    assert rc == 0, err[-3000:]
    from safetensors.torch import load_file
    got = load_file(str(tmp_path / "hub" / "model.safetensors"))
    want = load_file(str(run / "best_ema.safetensors"))  # a run folder's weights: the EMA of the best epoch
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)


@pytest.mark.parametrize("command", ["convert", "attention-map", "export", "predict", "validate"])
def test_a_folder_that_is_no_run_is_called_a_folder(tmp_path, capsys, command):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    argv = {"convert": ["convert", other, "--model", "vit3_tiny.digits", "--out", tmp_path / "hub"],
            "attention-map": ["attention-map", "--model", "vit3_tiny", "--checkpoint", other, "--query-pixel", 1, 1,
                              "--out", tmp_path / "a.png"],
            "export": ["export", "--model", "vit3_tiny", "--checkpoint", other, "--out", tmp_path / "m.onnx"],
            "predict": ["predict", ASSET_IMAGE, "--checkpoint", other],
            # validate takes a folder of weight files too: this one holds none
            "validate": ["validate", "--checkpoint", other, "--model", "vit3_tiny", "--data-dir", other]}[command]
    line = _one_error_line(*cli(capsys, *argv))
    assert "does not exist" not in line
    assert f"{other} is a folder" in line or \
        f"No checkpoint files (*.safetensors, *.pth, *.pt) in folder {str(other)!r}" in line


# ----- the recorded arguments -----

def test_recorded_args_merge_every_resume_in_epoch_order(tmp_path):
    import yaml
    (tmp_path / "args.yaml").write_text(yaml.safe_dump({"model": "vit3_tiny", "lr": 0.1, "epochs": 10}))
    (tmp_path / run_folder.resume_args_name(10)).write_text(yaml.safe_dump({"epochs": 30}))
    (tmp_path / run_folder.resume_args_name(2)).write_text(yaml.safe_dump({"epochs": 20, "lr": 0.05}))
    merged = {"model": "vit3_tiny", "lr": 0.05, "epochs": 30}
    assert run_folder.recorded_args(str(tmp_path)) == merged
    (tmp_path / "w.pth").write_bytes(b"")  # a file in the run folder: the resolver gives the same merged arguments
    resolved = run_folder.resolve_checkpoint(str(tmp_path / "w.pth"))
    assert resolved.run == merged and resolved.model == "vit3_tiny" and resolved.weights == str(tmp_path / "w.pth")


# ----- 2. every message about a run folder says what the folder holds -----

def test_resume_messages_say_what_the_folder_holds(tmp_path):
    from ttt_zoo.checkpoint import CheckpointError
    from ttt_zoo.train.run_state import resolve_resume
    with pytest.raises(CheckpointError, match="no such run folder"):
        resolve_resume(str(tmp_path / "missing"))
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is not a `ttt-zoo train` run folder \(it has no args.yaml and no "
                                              r"checkpoint.json\)"):
        resolve_resume(str(other))
    early = tmp_path / "early"  # killed between creating its folder and writing args.yaml
    early.mkdir()
    (early / "log.txt").write_text("")
    with pytest.raises(CheckpointError, match="stopped before it wrote its args.yaml.*run the command that started "
                                              "it again"):
        resolve_resume(str(early))
    (early / "args.yaml").write_text("model: vit3_tiny\n")  # nothing committed, args.yaml there: restarted from it
    assert resolve_resume(str(early)) == (str(early), None)
    with pytest.raises(CheckpointError, match="no epoch of the run .* was committed yet, so there is no best.state.pt"):
        resolve_resume(str(early / "best.state.pt"))


def test_sample_refuses_a_diffusion_run_file_that_differs_from_its_commit(tmp_path, capsys):
    """A real (tiny) `--task diffusion` run: `sample --checkpoint RUN` works, then with one byte of the file it
    picks (best_ema.safetensors) flipped it is refused in one line, as is the flipped file given directly."""
    data = make_tiny_digits(str(tmp_path / "digits"), img_size=8)
    from ttt_zoo.cli import main
    assert main(["train", "--task", "diffusion", "--model", "dit3_s_2", "--model-kwargs", "hidden_size=32", "depth=1",
                 "num_heads=2", "patch_size=2", "--img-size", "8", "--data-dir", data, "-b", "8", "-j", "0",
                 "--hflip", "0", "--opt", "adamw", "--lr", "3e-3", "--warmup-epochs", "0", "--epochs", "1",
                 "--model-ema", "--log-interval", "100", "--output", str(tmp_path), "--experiment", "d",
                 "--device", "cpu"]) == 0
    run = tmp_path / "d"
    sample = ["sample", "--steps", 2, "--labels", 0, 1, "--device", "cpu", "--out"]
    rc, err = cli(capsys, *sample, tmp_path / "ok.png", "--checkpoint", run)
    assert rc == 0 and (tmp_path / "ok.png").is_file(), err[-3000:]
    _flip_a_data_byte(run / "best_ema.safetensors")
    for given in (run, run / "best_ema.safetensors"):
        line = _one_error_line(*cli(capsys, *sample, tmp_path / "bad.png", "--checkpoint", given))
        assert f"{run / 'best_ema.safetensors'} is missing or differs from what {run / 'checkpoint.json'}" in line
    assert not (tmp_path / "bad.png").exists()
