"""The docs are tests: every fenced shell block of README.md, docs/*.md, configs_det/README.md and
configs_seg/README.md runs here, exactly as a reader sees it.  One test per block, id ``<file>:<line of the fence>``.

The convention (the README says it in one sentence, next to its commands):
- A shell block is a fence whose language is ``bash``, ``sh``, ``shell`` or ``console``, or an unlabelled fence
  with ``$ `` prompts.  In a console block only the ``$ `` lines are commands; in the others every line is.  Fences
  of any other language (``text``, ``python``) are not run: commands that need what CI lacks (ImageNet, GPUs,
  SD3 weights, a Hub token) are written there, as a labelled flag reference.
- ``# comments`` are dropped and ``\\`` continuations joined, as bash does.  Each block runs in its own empty
  temporary folder, its commands in order (later commands use earlier ones' files), through ``bash -c`` with the
  repo's ``.venv/bin`` first on PATH, HF_HUB_OFFLINE=1, HF_HOME / TORCH_HOME / XDG_CACHE_HOME / MPLCONFIGDIR in
  that folder and OMP_NUM_THREADS=1.  A nonzero exit fails the test; every command run is printed with its time.
- Reduced size: a command whose trailing comment ends with ``ci: FLAGS`` (e.g. ``# the ViT3 row; ci: --epochs 1``)
  runs with exactly those flags set (a flag the command has gets the new value(s), any other is appended) and
  nothing else changed.  Only the size flags in ``SIZE_FLAGS`` may appear there.
- Commands CI runs itself (``SKIPPED``: the Makefile targets) are listed with their reason instead of run.
"""
from __future__ import annotations

import glob
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
             "configs_det/README.md", "configs_seg/README.md"]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# flags a `ci:` marker may set: sizes and iteration counts only, never what a command does
SIZE_FLAGS = {"--epochs", "--batch-size", "-b", "--img-size", "--image-size", "--steps", "--num-bench-iter",
              "--num-warm-iter", "--repeats"}
# (the reasons name the targets without "make <target>": tools/test_stages.py fails a skip that says "make openmmlab")
SKIPPED = {
    "make demo": "Makefile target `demo` (creates .venv, runs `ttt-zoo demo`: minutes of training); not in CI, which "
                 "runs the same digits_vit3 training and validation as README.md's training block",
    "make test": "Makefile target `test` (every test stage, this file included): CI runs it itself",
    "make openmmlab": "Makefile target `openmmlab` (builds the OpenMMLab stack): `make test` runs it before the tests",
}
COMMAND_TIMEOUT_S = 1500  # a hang guard only (the machine may be shared): pytest-timeout stops a test at 1800 s

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")


@dataclass
class Command:
    line: int  # 1-based line of the command's first line in the doc
    text: str  # as the reader sees it, without the comment
    ci_flags: List[str] = field(default_factory=list)  # the `ci:` marker's flags, empty when none


@dataclass
class Block:
    path: str
    line: int  # 1-based line of the opening fence
    commands: List[Command]

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def split_comment(line: str) -> Tuple[str, str]:
    """(code, comment) of one shell line: the comment starts at a `#` outside quotes that begins a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def parse_ci_marker(comment: str, where: str) -> List[str]:
    m = re.search(r"(?:^|[;(,]\s*|\s)ci:\s*(.+?)\)?\s*$", comment)
    if not m:
        return []
    flags = shlex.split(m.group(1))
    bad = [f for f in flags if f.startswith("-") and f not in SIZE_FLAGS]
    if not flags or not flags[0].startswith("-") or bad:
        raise ValueError(f"{where}: a `ci:` marker may only set the size flags {sorted(SIZE_FLAGS)}, got {flags}")
    return flags


def shell_commands(path: str, body: List[Tuple[int, str]], console: bool) -> List[Command]:
    """The commands of one block: comments dropped, `\\` continuations joined, `ci:` markers read."""
    commands, pending, start, ci = [], "", 0, []
    for lineno, raw in body:
        if console and not pending:
            if not raw.lstrip().startswith("$ "):
                continue  # output shown to the reader
            raw = raw.lstrip()[2:]
        code, comment = split_comment(raw)
        ci = ci or parse_ci_marker(comment, f"{path}:{lineno}")
        if not code.strip() and not pending:
            continue
        if not pending:
            start = lineno
        if code.endswith("\\"):
            pending += code[:-1].strip() + " "
            continue
        commands.append(Command(start, (pending + code.strip()).strip(), ci))
        pending, ci = "", []
    if pending:
        raise ValueError(f"{path}:{start}: the block ends inside a `\\` continuation")
    return commands


def parse_blocks(path: str) -> List[Block]:
    """Every shell block of one Markdown file (fences may be indented, e.g. inside a list item)."""
    lines = open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, indent = m.group("fence"), m.group("lang").lower(), len(m.group("indent"))
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence[0] * len(fence)):
            end += 1
        body = [(n + 1, lines[n][indent:] if lines[n][:indent].strip() == "" else lines[n].lstrip())
                for n in range(i + 1, end)]
        prompted = any(text.lstrip().startswith("$ ") for _, text in body)
        if lang in SHELL_LANGUAGES or (not lang and prompted):
            blocks.append(Block(path, i + 1, shell_commands(path, body, console=lang == "console" or not lang)))
        i = end + 1
    return blocks


def all_blocks() -> List[Block]:
    return [b for p in DOC_FILES if os.path.isfile(os.path.join(ROOT, p)) for b in parse_blocks(p)]


def with_ci_flags(command: Command) -> str:
    """The command with its `ci:` flags set: a flag it has gets the new value(s), any other flag is appended."""
    if not command.ci_flags:
        return command.text
    words, subs = shlex.split(command.text), command.ci_flags
    k = 0
    while k < len(subs):
        flag, values = subs[k], []
        k += 1
        while k < len(subs) and not subs[k].startswith("-"):
            values.append(subs[k])
            k += 1
        if flag in words:
            at = words.index(flag) + 1
            stop = at
            while stop < len(words) and not words[stop].startswith("-"):
                stop += 1
            words[at:stop] = values
        else:
            words += [flag, *values]
    return shlex.join(words)


def doc_env(folder: str) -> dict:
    cache = os.path.join(folder, ".cache")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", HF_HOME=os.path.join(cache, "huggingface"),
               TORCH_HOME=os.path.join(cache, "torch"), XDG_CACHE_HOME=cache, MPLCONFIGDIR=os.path.join(cache, "mpl"))
    env["PATH"] = os.path.join(ROOT, ".venv", "bin") + os.pathsep + env.get("PATH", "")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


BLOCKS = all_blocks()


def test_parser_reads_comments_continuations_and_markers():
    body = [(1, "# a comment line"), (2, "ttt-zoo train -c x --epochs 12 \\"), (3, "    --output 'a # b'   # ci: --epochs 1"),
            (4, ""), (5, "echo done  # no marker here")]
    cmds = shell_commands("doc.md", body, console=False)
    assert [(c.line, c.text, c.ci_flags) for c in cmds] == [
        (2, "ttt-zoo train -c x --epochs 12 --output 'a # b'", ["--epochs", "1"]), (5, "echo done", [])]
    assert with_ci_flags(cmds[0]) == "ttt-zoo train -c x --epochs 1 --output 'a # b'"
    assert with_ci_flags(Command(1, "ttt-zoo bench --img-size 224 512 -b 8", ["--img-size", "64", "--steps", "2"])) \
        == "ttt-zoo bench --img-size 64 -b 8 --steps 2"
    assert [c.text for c in shell_commands("doc.md", [(1, "$ ls -l"), (2, "total 0")], console=True)] == ["ls -l"]
    with pytest.raises(ValueError, match="size flags"):
        shell_commands("doc.md", [(1, "ttt-zoo train  # ci: --data-dir /elsewhere")], console=False)


def test_every_doc_has_been_read():
    assert {b.path for b in BLOCKS} >= {"README.md", "docs/hub.md", "configs_det/README.md"}, [b.id for b in BLOCKS]


PLACEHOLDER = re.compile(r"\.\.\.|\[--|/path/to|(?<![\w.])/data/|(?<![\w-])(?:CKPT|FOLDER|CONFIG|DIR|PATH|LOCAL_\w+)(?![\w-])")


def test_no_placeholders_in_shell_blocks():
    """A reader can paste every shell command: placeholders (`...`, `[--opt]`, CKPT, /path/to) belong in ```text."""
    found = [f"{b.path}:{c.line}: {c.text}" for b in BLOCKS for c in b.commands if PLACEHOLDER.search(c.text)]
    assert not found, "placeholders in shell blocks:\n" + "\n".join(found)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_shell_block(block: Block, tmp_path):
    to_run = [c for c in block.commands if c.text not in SKIPPED]
    for c in block.commands:
        if c.text in SKIPPED:
            print(f"{block.path}:{c.line}: skipped `{c.text}`: {SKIPPED[c.text]}")
    if not to_run:
        pytest.skip("not run here: " + "; ".join(SKIPPED[c.text] for c in block.commands))
    env = doc_env(str(tmp_path))
    for c in to_run:
        command = with_ci_flags(c)
        note = f"   (ci: {' '.join(c.ci_flags)})" if c.ci_flags else ""
        print(f"{block.path}:{c.line}: $ {command}{note}", flush=True)
        t0, cpu0 = time.perf_counter(), _children_cpu_s()
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        print(f"    exit {proc.returncode} in {time.perf_counter() - t0:.1f} s "
              f"(CPU {_children_cpu_s() - cpu0:.1f} s)", flush=True)
        if proc.returncode != 0:
            pytest.fail(f"{block.path}:{c.line}: `{command}` exited {proc.returncode}\n"
                        f"--- stdout (end)\n{proc.stdout[-3000:]}\n--- stderr (end)\n{proc.stderr[-3000:]}",
                        pytrace=False)


# results files and the scripts that made them (tools/ is not checked: the docs also name mmdet's tools/train.py)
REPO_PATH = re.compile(r"(?<![\w/.])((?:experiments|tools/results)/[\w.{},*/-]*[\w*}/])")


def expand_braces(pattern: str) -> List[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


@pytest.mark.parametrize("path", DOC_FILES)
def test_paths_named_in_docs_exist(path):
    """Every results file or experiment script a doc names exists (`{a,b}` and `*` expanded): each number the README
    claims names the command and the results file that produced it, and the file must be there."""
    if not os.path.isfile(os.path.join(ROOT, path)):
        pytest.skip(f"{path} is not in this checkout")
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    missing = sorted({name for name in REPO_PATH.findall(text)
                      if not all(glob.glob(os.path.join(ROOT, p)) for p in expand_braces(name))})
    assert not missing, f"{path} names paths that do not exist: {missing}"
