"""Issue 30's faults, each fix reverted on today's tree: which of today's tests fail.

    python experiments/fault_reverts.py                 # every fault -> results/fault_reverts.md
    python experiments/fault_reverts.py --only 1 8f     # some of them (the table keeps the others' last rows)

For each fault a git worktree of HEAD gets one small edit that undoes its fix (the edit's old text must occur exactly
once, so a stale edit stops the run instead of testing nothing), then today's tests named for it run there with the
worktree's own ``ttt_zoo`` (``PYTHONPATH``).  The same tests run once on the unedited tree as the control: a fault
counts as found when some of its tests fail with the edit and all of them pass without it.  Faults 4-7 and the slow
``list`` of fault 8 are shown by the registry contract table on the commits before their fixes
(``registry_contract_table.py``); this script covers the rest: 1-3 and fault 8's other items, and the two
ONNX faults (o1, o2) that the contract's ONNX column found once it ran every code path.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
OUT = os.path.join(RESULTS, "fault_reverts.md")
RUNS = os.path.join(RESULTS, "fault_reverts.json")


@dataclass
class Fault:
    key: str
    fault: str  # the words
    revert: str  # what the edit does
    edits: List[Tuple[str, str, str]]  # (path, old text, new text)
    tests: List[str]  # pytest node ids or files, today's tests
    extra: List[str] = field(default_factory=list)  # more pytest arguments (-k ...)
    note: str = ""  # what the counts mean, where it is not plain


FAULTS = [
    Fault("1", "every recipe crashes in its first epoch (posterize asks Pillow 13 for 0 bits)",
          "the training transform is timm's own, without the posterize guard",
          [("ttt_zoo/train/augment.py", "    guard_posterize(t)\n    return t\n", "    return t\n")],
          ["tests/test_augment.py", "tests/test_recipes.py::test_zero_bit_posterize_inside_ttt_zoo_train",
           "tests/test_recipes.py::test_recipe_runs_a_few_steps"],
          note="every recipe's 2-step run passes with the guard removed: an image draws 0 bits with probability "
               "about 0.15 %, so the tests that force magnitude 10 (the op, the policy, and a `ttt-zoo train` with "
               "`--aa rand-m10-n30-p1.0-inc1`) are the ones that fail every time; that is why they exist"),
    Fault("2", "the README's digits command does not give the README's number",
          "the README shows the old command (timm's defaults and hand-written flags, no shipped recipe)",
          [("README.md", "ttt-zoo train -c digits_vit3 --data-dir data/digits --output runs --experiment vit3   ",
            "ttt-zoo train --data-dir data/digits --model vit3_tiny --img-size 32 --num-classes 10 --epochs 12 "
            "--model-kwargs patch_size=4 embed_dim=96 depth=4 num_heads=3 --hflip 0 --output runs --experiment vit3   ")],
          ["tests/test_recipes.py::test_digits_recipes_are_the_readme_table"]),
    Fault("3", "`ttt-zoo validate --checkpoint runs/vit3` does not read the run's args.yaml",
          "validate ignores the run folder's args.yaml",
          [("ttt_zoo/cli/validate.py", '    apply_run_defaults(args, resolved, _RUN_FLAGS, always=("data_dir", "split"))\n',
            "")],
          ["tests/test_cli_errors.py::test_resume_and_validate_read_the_run_args", "tests/test_docs.py"],
          ["-k", "read_the_run_args or README.md:84"]),
    Fault("8a", "forward_features layouts differ undeclared (NCHW for hvit3, NHWC for vit3 and visionttt_h)",
          "the plain families no longer declare output_fmt NHWC (the default NCHW stays)",
          [("ttt_zoo/models/_plain.py", '        self.output_fmt = "NHWC"\n', "")],
          ["tests/test_output_fmt.py"]),
    Fault("8b", "`ttt-zoo list --filter 'vit3*'` silently matches nothing",
          "a filter matches a whole name only (no wildcards)",
          [("ttt_zoo/cli/list.py", 'fnmatch.fnmatchcase(name, p if any(c in p for c in "*?[") else f"*{p}*")',
            "name == p")],
          ["tests/test_model_stats.py::test_filters_follow_timm",
           "tests/test_model_stats.py::test_a_filter_matching_nothing_is_one_clear_line",
           "tests/test_cli_list.py::test_patterns_match_as_timm_list_models"]),
    Fault("8c", "`convert` refuses a custom tag (a user's fine-tune gets the hub id ttt-zoo/<model>.in1k)",
          "convert accepts registered tags only, and no --tag",
          [("ttt_zoo/cli/convert.py", "    if not tag:\n        return model\n",
            "    from ttt_zoo.hub import registered_pretrained\n"
            "    if tag or ('.' in model and model not in registered_pretrained()):\n"
            "        raise HubFolderError(f'unknown pretrained tag in {model!r}')\n"
            "    return model\n")],
          ["tests/test_hub_layout.py::test_custom_tag_names_the_users_weights"]),
    Fault("8d", "a card for random weights converted as `.in1k` lists the authors' 76.5 top-1",
          "the card states the authors' results whenever the name has them",
          [("ttt_zoo/hub/convert.py", "    arch, tag = _split(name)\n    if arch in _HUB_ARCHS:  # no registered url",
            "    return True\n    arch, tag = _split(name)\n    if arch in _HUB_ARCHS:  # no registered url")],
          ["tests/test_hub_layout.py::test_authors_numbers_only_for_their_release"]),
    Fault("8e", "the `sample` grid has 16-px tiles and no way to enlarge them",
          "the grid ignores --upscale",
          [("ttt_zoo/sampling.py", "    if upscale > 1:\n", "    if False:\n")],
          ["tests/test_sampling.py::test_grid_upscale_is_nearest_neighbour_and_sized"]),
    Fault("8f", "`attention-map` stretches a non-square photo to a square",
          "the plot is drawn at the model's square input size",
          [("ttt_zoo/cli/attention_map.py", "    oh, ow = orig_size or (h, w)\n", "    oh, ow = h, w\n")],
          ["tests/test_attention_map.py::test_plot_keeps_the_aspect_ratio_and_draws_a_colour_bar"]),
    Fault("8g", "`attention-map` has no colour bar",
          "no colour bar is drawn",
          [("ttt_zoo/cli/attention_map.py", "    if shown is not None:\n        fig.colorbar(",
            "    if False:\n        fig.colorbar(")],
          ["tests/test_attention_map.py::test_plot_keeps_the_aspect_ratio_and_draws_a_colour_bar"]),
    Fault("o1", "(found by the per-code-path ONNX column) the V1/V3/V6 graphs run at the traced size only",
          "the variant op takes int() of the map size again",
          [("kernels/vit3_variant/torch.py", "    fs = tuple(s if isinstance(s, (int, torch.SymInt)) else int(s) for s in "
            "feat_size)\n", "    fs = (int(feat_size[0]), int(feat_size[1]))\n")],
          ["tests/test_registry_contract.py::test_onnx_export[vit3_tiny_v1]", "tests/test_onnx.py"]),
    Fault("o2", "(found by the per-code-path ONNX column) visionttt_*_la graphs fail in onnxruntime",
          "the chunk count is -(-n // c) again",
          [("kernels/linear_attention/torch.py", "    nc = (n + c - 1) // c", "    nc = -(-n // c)")],
          ["tests/test_registry_contract.py::test_onnx_export[visionttt_tiny_la]"]),
]


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, check=True).stdout.strip()


def _edit(tree: str, path: str, old: str, new: str) -> None:
    full = os.path.join(tree, path)
    text = open(full).read()
    if text.count(old) != 1:
        raise SystemExit(f"error: the revert edit of {path} expects its old text once, found it "
                         f"{text.count(old)} times; update FAULTS in {__file__}:\n{old}")
    with open(full, "w") as f:
        f.write(text.replace(old, new))


def _pytest(tree: str, tests: List[str], extra: List[str]) -> dict:
    """Run ``tests`` in ``tree``: {'passed', 'failed', 'tests', 'failures': [(test id, first line)]}."""
    xml = os.path.join(tree, "junit.xml")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=tree, TRITON_INTERPRET="0",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests, *extra,
           f"--junitxml={xml}"]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if not os.path.isfile(xml):
        raise SystemExit(f"error: no junit file from `{' '.join(cmd[2:])}`:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    out = dict(tests=0, failed=0, passed=0, skipped=0, failures=[])
    for case in ET.parse(xml).getroot().iter("testcase"):
        out["tests"] += 1
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            out["failed"] += 1
            msg = (bad.get("message") or "").strip().splitlines()
            out["failures"].append((f"{case.get('classname').split('.')[-1]}::{case.get('name')}",
                                    (msg[0] if msg else "")[:160]))
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def _worktree(base: str, name: str) -> str:
    tree = os.path.join(base, name)
    _git("worktree", "add", "--detach", "-q", tree, "HEAD")
    venv = os.path.join(ROOT, ".venv")
    if os.path.isdir(venv):  # the docs test runs the commands from the tree's .venv/bin (`ttt-zoo`, ...)
        os.symlink(venv, os.path.join(tree, ".venv"))
    return tree


def run(faults: List[Fault], base: str) -> dict:
    # ../shared beside each worktree, as beside the checkout (fixtures, papers)
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    if os.path.isdir(shared) and not os.path.exists(os.path.join(base, "shared")):
        os.symlink(shared, os.path.join(base, "shared"))
    results = {}
    for f in faults:
        for label in ("reverted", "today"):
            tree = _worktree(base, f"{f.key}-{label}")
            try:
                if label == "reverted":
                    for path, old, new in f.edits:
                        _edit(tree, path, old, new)
                r = _pytest(tree, f.tests, f.extra)
            finally:
                _git("worktree", "remove", "--force", tree)
            results.setdefault(f.key, {})[label] = r
            results[f.key]["commit"] = _git("rev-parse", "--short", "HEAD")
            print(f"fault {f.key} {label}: {r['failed']} of {r['tests']} failed", flush=True)
    return results


def render(runs: dict, commit: str) -> str:
    lines = [f"<!-- generated by experiments/fault_reverts.py, at commit {commit} -->",
             "# Issue 30's faults with each fix reverted: the tests that find them", "",
             "Each row: one small edit on a worktree of today's tree that undoes the fix, then today's tests for it, "
             "run there and on the unedited tree (the control). Found: some test fails with the edit and none "
             "without. Faults 4-7 and the slow `list` are in `registry_contract.md` (the contract test on the "
             "commits before their fixes). `ttt-zoo predict` (issue 30, item 6) was a missing command, not a fault. "
             "o1 and o2 are faults that the contract's ONNX column found once it ran every code path, variants "
             "included (it ran once per family before).",
             "", "| fault | the fix reverted | tests | failed, reverted | failed, today | found | tree |",
             "|---|---|---|---|---|---|---|"]
    for f in FAULTS:
        r = runs.get(f.key)
        if not r:
            continue
        rev, today = r["reverted"], r["today"]
        found = "yes" if rev["failed"] and not today["failed"] else "NO"
        tests = ", ".join(f"`{t.replace('tests/', '')}`" for t in f.tests) + (
            f" ({' '.join(f.extra)})" if f.extra else "")
        lines.append(f"| {f.key}: {f.fault} | {f.revert} | {tests} | {rev['failed']} of {rev['tests']} | "
                     f"{today['failed']} of {today['tests']} | {found} | `{r.get('commit', '?')}` |")
    lines += ["", "## The failing tests with each fix reverted (first line of each failure)", ""]
    for f in FAULTS:
        if f.key in runs:
            lines.append(f"- **{f.key}**:" + (f" ({f.note})" if f.note else ""))
            lines += [f"  - `{t}`: {m}" for t, m in runs[f.key]["reverted"]["failures"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="KEY", help="run these faults (default: all)")
    args = ap.parse_args(argv)
    keys = [f.key for f in FAULTS]
    unknown = sorted(set(args.only or []) - set(keys))
    if unknown:
        raise SystemExit(f"error: unknown fault {', '.join(unknown)}; choose from {', '.join(keys)}")
    if _git("status", "--porcelain", "--untracked-files=no"):
        print("note: the worktrees are of HEAD; uncommitted changes are not tested", file=sys.stderr)
    runs = json.load(open(RUNS)) if os.path.isfile(RUNS) else {}
    base = tempfile.mkdtemp(prefix="fault_reverts_")
    try:
        runs.update(run([f for f in FAULTS if not args.only or f.key in args.only], base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        _git("worktree", "prune")
    from ttt_zoo.fileio import atomic_write
    atomic_write(RUNS, json.dumps(runs, indent=1) + "\n")
    atomic_write(OUT, render(runs, _git("rev-parse", "--short", "HEAD")))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
