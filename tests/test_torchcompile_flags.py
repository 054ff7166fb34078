"""``--torchcompile [BACKEND]`` / ``--torchcompile-mode`` (timm's spellings) on every command that runs a model: a bad
value is one ``error:`` line, exit status 2, before any work (nothing written).  The compiled runs themselves:
``tests/test_compile.py`` (compile stage)."""
import os

import pytest

from ttt_zoo.torchcompile import MODES

from test_cli_errors import cli  # (exit status, stderr) of `ttt-zoo ARGV` in this process

COMMANDS = {
    "train": lambda out: ["train", "--model", "vit3_tiny", "--data-dir", out, "--output", out, "--epochs", "1"],
    "validate": lambda out: ["validate", "--model", "vit3_tiny", "--data-dir", out, "--pretrained",
                             "--results-file", os.path.join(out, "r.csv")],
    "predict": lambda out: ["predict", out, "--model", "vit3_tiny", "--results-file", os.path.join(out, "r.csv")],
    "sample": lambda out: ["sample", "--model", "dit3_s_2", "--tiny", "--steps", "1", "--out",
                           os.path.join(out, "s.png")],
    "bench": lambda out: ["bench", "--model", "vit3_tiny", "--output", out],
}
BAD = [
    (["--torchcompile", "no_such_backend"], "is not a torch.compile backend"),
    (["--torchcompile-mode", "reduce-overhead"], "needs --torchcompile"),
    (["--torchcompile", "eager", "--torchcompile-mode", "max-autotune"], "is inductor's"),
    (["--torchcompile", "--torchcompile-mode", "fastest"], "invalid choice"),
]


# (bench: a mode alone is the mode of --runtime compile's inductor)
CASES = [(c, f, why) for c in sorted(COMMANDS) for f, why in BAD
         if not (c == "bench" and f[0] == "--torchcompile-mode")]


@pytest.mark.parametrize("command,flags,phrase", CASES, ids=[f"{c}-{why}" for c, _, why in CASES])
def test_bad_torchcompile_is_one_line(command, flags, phrase, tmp_path, capsys):
    rc, err = cli(capsys, *COMMANDS[command](str(tmp_path)), *flags)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], err
    assert "Traceback" not in err and ";" in lines[0]  # what was wrong; how to fix it
    assert os.listdir(tmp_path) == []  # nothing written, no run folder


def test_the_flags_are_timms():
    """nargs='?' with const inductor (timm's train.py / validate.py), the same modes on every command."""
    from ttt_zoo.cli import build_parser
    from ttt_zoo.train.args import build_parser as train_parser
    parsers = [train_parser()] + [a.choices[c] for a in build_parser()._actions if hasattr(a, "choices")
                                  and isinstance(a.choices, dict) for c in ("validate", "predict", "sample", "bench")]
    assert len(parsers) == 5
    for p in parsers:
        assert p.parse_known_args(["--torchcompile"])[0].torchcompile == "inductor"
        assert p.parse_known_args(["--torchcompile", "aot_eager"])[0].torchcompile == "aot_eager"
        assert p.parse_known_args([])[0].torchcompile is None
        mode = next(a for a in p._actions if a.dest == "torchcompile_mode")
        assert tuple(mode.choices) == MODES and "reduce-overhead" in MODES
