"""Every numeric flag of every `ttt-zoo` command has a declared range (ttt_zoo.flags.Range, beside the flag): read from
the parsers, so a new numeric flag without one fails here.  A value below and one above the range each give one
`error:` line naming the flag, exit status 2, before any work (issue 36, deliverable 4)."""
import pytest

from ttt_zoo.cli._ranges import numeric_flags
from ttt_zoo.flags import MODEL_KWARG_RANGES

from test_cli_errors import cli  # (exit status, stderr) of `ttt-zoo ARGV` in this process

FLAGS = numeric_flags()


def _id(f):
    return " ".join(f.command[:1] + f.command[2:] + [f.flag])


def test_every_numeric_flag_declares_a_range():
    missing = [_id(f) for f in FLAGS if f.range is None]
    assert not missing, f"numeric flags without a ttt_zoo.flags.Range: {missing}"
    assert len(FLAGS) > 90  # every command's (train's for each --task)
    commands = {f.command[0] for f in FLAGS}
    assert {"train", "validate", "predict", "sample", "bench", "attention-map", "export", "list", "demo",
            "data"} <= commands


@pytest.mark.parametrize("flag", FLAGS, ids=_id)
def test_default_is_inside_the_range(flag):
    d = flag.action.default
    for v in (d if isinstance(d, list) and not isinstance(d, tuple) else [d]) if d is not None else []:
        assert flag.range.problem(v) is None, (flag.flag, v)


@pytest.mark.parametrize("flag", FLAGS, ids=_id)
def test_below_and_above_the_range_is_one_line(flag, capsys):
    for side, value in zip(("below", "above"), flag.range.outside()):
        assert flag.range.problem(value) is not None
        rc, err = cli(capsys, *flag.command, flag.flag, *[value] * flag.nargs)
        lines = err.strip().splitlines()
        assert rc == 2, (side, value, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
        assert f"argument {flag.flag}" in lines[0] or any(f"argument {o}" in lines[0]
                                                          for o in [
                                                              "/".join(flag.action.option_strings)]), lines[0]
        assert "out of range" in lines[0] and flag.range.text().split(" (")[0] in lines[0], lines[0]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_not_finite_is_refused(value, capsys):
    rc, err = cli(capsys, "train", f"--lr={value}")
    assert rc == 2 and err.count("\n") == 1 and "argument --lr" in err and "not a finite number" in err, err


@pytest.mark.parametrize("key", sorted(MODEL_KWARG_RANGES))
def test_model_kwargs_sizes_are_capped(key, capsys):
    for value in MODEL_KWARG_RANGES[key].outside():
        for argv in (["train", "--model-kwargs", f"{key}={value}"], ["validate", "--model-kwargs", f"{key}={value}"],
                     ["predict", "--model-args", f'{{"{key}": {value}}}'],
                     ["bench", "--model-kwargs", f"{key}={value}"]):
            rc, err = cli(capsys, *argv)
            assert rc == 2 and err.count("\n") == 1 and f"{key}={value}" in err and "out of range" in err, err


def test_model_kwargs_weights_estimate(capsys):
    rc, err = cli(capsys, "predict", "--model-kwargs", "depth=1000", "embed_dim=16384")
    assert rc == 2 and "billion weights" in err and err.count("\n") == 1, err


def test_config_file_values_are_checked(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: -1\n")
    rc, err = cli(capsys, "train", "-c", cfg)
    assert rc == 2 and "argument --lr: -1 is out of range" in err and f"--config {cfg}" in err, err
    cfg.write_text("clip_grad: -1\n")
    rc, err = cli(capsys, "train", "-c", cfg)
    assert rc == 2 and "leave out --clip-grad to turn clipping off" in err, err
