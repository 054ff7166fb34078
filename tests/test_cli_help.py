"""``ttt-zoo --help`` and every ``ttt-zoo CMD --help`` import no torch, timm or torchvision (issue 49 item 1),
``import ttt_zoo`` still registers every model, and each flag's help shows its default once.

The timing itself is a benchmark, not a test: ``experiments/help_timing.py``."""
import argparse
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ttt_zoo.cli import COMMANDS, build_parser
from ttt_zoo.train.task_flags import TASKS

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "timm", "torchvision")
#: the console script as pyproject.toml declares it, run as pip's wrapper runs it
ENTRY = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["ttt-zoo"].split("#")[0].strip()


def run_entry(*argv: str) -> dict:
    """Run the console script's entry with ``argv`` in a fresh interpreter: its exit code, output and the heavy
    modules imported by the end."""
    module, func = ENTRY.split(":")
    code = (f"import sys, json, importlib\nsys.argv = ['ttt-zoo', *{list(argv)!r}]\n"
            f"try:\n    rc = importlib.import_module({module!r}).{func}()\nexcept SystemExit as e:\n    rc = e.code\n"
            f"print(json.dumps(dict(rc=rc, heavy=[m for m in {HEAVY!r} if m in sys.modules])), file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    return dict(json.loads(p.stderr.strip().splitlines()[-1]), out=p.stdout, err=p.stderr)


def command_names():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = list(sub.choices)
    assert len(names) == len(COMMANDS)  # every module of COMMANDS adds one command
    return names


@pytest.mark.parametrize("argv", [("--help",)] + [(name, "--help") for name in command_names()]
                         + [("train", "--task", task, "--help") for task in TASKS],
                         ids=" ".join)
def test_help_imports_no_torch(argv):
    r = run_entry(*argv)
    assert r["rc"] == 0 and "usage: ttt-zoo" in r["out"], r["err"]
    assert r["heavy"] == [], f"ttt-zoo {' '.join(argv)} imported {r['heavy']}"


def test_a_usage_error_imports_no_torch():
    r = run_entry("list", "--img-size", "0")
    assert r["rc"] == 2 and r["heavy"] == [] and "--img-size" in r["err"]


def test_the_entry_runs_a_command_with_the_package_imported_in_full():
    # after parsing, the package's __init__ runs: the models registered, its names there
    r = run_entry("list", "vit3_tiny*", "--exclude", "*_v?")
    assert r["rc"] == 0 and "torch" in r["heavy"] and "timm" in r["heavy"], r["err"]
    rows = r["out"].splitlines()[1:]
    assert [row.split()[0] for row in rows] == ["vit3_tiny"]


def test_import_ttt_zoo_registers_every_model():
    code = ("import timm, ttt_zoo\nfrom ttt_zoo.models import MODEL_MODULES\n"
            "print(len([n for m in MODEL_MODULES for n in timm.list_models(module=m)]), ttt_zoo.__version__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    count, version = out.stdout.split()
    from ttt_zoo import __version__, list_zoo_models
    assert int(count) == len(list_zoo_models(include_diffusion=True)) > 0 and version == __version__


def option_entries(text: str):
    """The help of each option: from a line starting with ``-`` to the next, joined on one line."""
    entries, cur = [], None
    for line in text.splitlines():
        if re.match(r"\s{2}-", line):
            cur = [line.strip()]
            entries.append(cur)
        elif cur is not None and line.startswith(" " * 6):
            cur.append(line.strip())
        else:
            cur = None
    return [" ".join(e) for e in entries]


def all_helps():
    """``(command, help text)`` of every command (and of data's subcommands), and the trainer's own parser."""
    from ttt_zoo.train.args import build_parser as train_parser
    from ttt_zoo.train.task import TASKS, get_task_class
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        yield name, p.format_help()
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                yield from ((f"{name} {n}", q.format_help()) for n, q in a.choices.items())
    for task in TASKS:
        yield f"train --task {task}", train_parser(get_task_class(task)).format_help()


def test_each_default_is_shown_once():
    seen = 0
    for name, text in all_helps():
        for entry in option_entries(text):
            seen += 1
            assert entry.count("(default") <= 1, f"ttt-zoo {name}: {entry}"
            assert "(default: None)" not in entry and "(default: False)" not in entry, f"ttt-zoo {name}: {entry}"
    assert seen > 200


def test_the_trainer_shows_a_default_its_help_does_not_name():
    from ttt_zoo.train.args import build_parser as train_parser
    entries = option_entries(train_parser().format_help())
    assert any(e.startswith("-b BATCH_SIZE") and e.endswith("(default: 128)") for e in entries)
    assert any(e.startswith("--num-classes") and e.endswith("(default: the model's)") for e in entries)
