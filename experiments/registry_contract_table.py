"""The registry contract table of issue 30, item 1: ``tests/test_registry_contract.py`` run with ``--junitxml``,
one row per registered model, one column per promise, written to ``experiments/results/registry_contract.md``.

    python experiments/registry_contract_table.py                    # today's tree: runs the test, renders
    python experiments/registry_contract_table.py --tree /tmp/old --label c250883   # the same test file in an
                                                                    # older tree (a git worktree), added as a section

Each run's junit file is kept in ``experiments/results/registry_contract/<label>.xml``; the markdown renders every
kept run, today's first.  A per-code-path promise's cell names the representative that covered it.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
RUNS = os.path.join(RESULTS, "registry_contract")
OUT = os.path.join(RESULTS, "registry_contract.md")
TODAY = "today"
TEST = "tests/test_registry_contract.py"


def _contract():
    """Today's test module: the promises, the registry, its code paths."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_registry_contract as contract
    return contract


def _git(tree, *args):
    return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True).stdout.strip()


def run_tests(tree: str, label: str, select: str = "") -> str:
    """Run the contract test in ``tree`` (its own ``ttt_zoo`` imported); the junit file's path."""
    os.makedirs(RUNS, exist_ok=True)
    xml = os.path.join(RUNS, f"{label}.xml")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=tree, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", TEST,
           f"--junitxml={xml}.tmp"] + (["-k", select] if select else [])
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if not os.path.isfile(f"{xml}.tmp"):
        raise SystemExit(f"error: no junit file from `{' '.join(cmd[2:])}` in {tree}:\n{proc.stdout[-3000:]}")
    root = ET.parse(f"{xml}.tmp").getroot()
    for case in root.iter("testcase"):  # keep each failure's message, not its traceback or captured output
        for el in list(case):
            if el.tag in ("failure", "error", "skipped"):
                el.text = None
            else:
                case.remove(el)
    root.set("tree_commit", _git(tree, "rev-parse", "--short", "HEAD") or "?")
    root.set("tree_subject", _git(tree, "log", "-1", "--format=%s")[:120])
    from ttt_zoo.fileio import replace_file
    ET.ElementTree(root).write(f"{xml}.tmp")
    replace_file(f"{xml}.tmp", xml)
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output")
    return xml


def _cases(xml: str):
    """{(test function, param id): (outcome, seconds, first line of the failure)} and the file's root."""
    root = ET.parse(xml).getroot()
    cases = {}
    for case in root.iter("testcase"):
        m = re.fullmatch(r"(\w+)(?:\[(.*)\])?", case.get("name"))
        outcome, why = "pass", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "FAIL", "error": "ERROR", "skipped": "skip"}[tag]
                why = (el.get("message") or "").splitlines()[0][:110] if el.get("message") else ""
        cases[(m.group(1), m.group(2))] = (outcome, float(case.get("time", 0)), why)
    return cases, root


def _cell(contract, cases, promise, name):
    """(text, outcome) of one cell; outcome is 'pass', 'n/a' or a failure."""
    func = contract.PROMISES[promise]
    if promise in contract.PER_CODE_PATH:
        if contract.is_diffusion(name) and promise in contract.NOT_APPLICABLE:
            return "n/a", "n/a"
        rep = contract.representative(promise, name)
        got = [v for (f, p), v in cases.items() if f == func and p is not None and
               rep in p.split("-")]
        if not got:
            return "not run", "not run"
        bad = [g for g in got if g[0] != "pass"]
        outcome = bad[0][0] if bad else "pass"
        text = outcome if rep == name else f"{outcome} (= {rep})"
        return text, outcome
    got = cases.get((func, name))
    if got is None:
        return "not run", "not run"
    return got[0], got[0]


def render(contract, xml: str, title: str):
    cases, root = _cases(xml)
    promises = list(contract.PROMISES)
    lines = [f"## {title}", ""]
    commit = root.get("tree_commit", "?")
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    lines.append(f"Tree at `{commit}` ({root.get('tree_subject', '')}). pytest: {suite.get('tests')} tests, "
                 f"{suite.get('failures')} failed, {suite.get('errors')} errors, {suite.get('skipped')} skipped, "
                 f"{float(suite.get('time', 0)):.0f} s of summed test time.")
    lines.append("")
    rows, counts, failing, not_run = [], collections.Counter(), collections.defaultdict(list), collections.Counter()
    for name in contract.NAMES:
        cells = []
        for p in promises:
            text, outcome = _cell(contract, cases, p, name)
            counts[outcome] += 1
            if outcome == "not run":
                not_run[p] += 1
            elif outcome not in ("pass", "n/a"):
                failing[p].append(name)
            cells.append(f"**{text}**" if outcome not in ("pass", "n/a", "not run") else text)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    total = len(contract.NAMES) * len(promises)
    lines.append(f"{len(contract.NAMES)} models x {len(promises)} promises = {total} cells: {counts['pass']} pass, "
                 f"{counts['n/a']} n/a, {total - counts['pass'] - counts['n/a']} not passing"
                 + "".join(f" ({k} {v})" for k, v in sorted(counts.items()) if k not in ("pass", "n/a")) + ".")
    lines.append("")
    if not_run:
        lines.append("Not run (deselected with -k, as they test no fault fixed since): " + ", ".join(
            f"{p} ({n} cells)" for p, n in not_run.items()) + ".")
        lines.append("")
    if failing:
        lines.append("Failing cells, by promise (the first line of each distinct failure):")
        lines.append("")
        for p in promises:
            if p in failing:
                whys = sorted({re.sub(r"'\w+'|\w+_\w+: ", "", v[2]) for (f, _), v in cases.items()
                               if f == contract.PROMISES[p] and v[0] != "pass"})
                lines.append(f"- `{p}` ({len(failing[p])} models): {', '.join(failing[p])}")
                lines.extend(f"  - {w}" for w in whys[:4] if w)
        lines.append("")
    lines.append("| model | " + " | ".join(promises) + " |")
    lines.append("|---|" + "---|" * len(promises))
    lines.extend(rows)
    lines.append("")
    cost = collections.Counter()
    for (f, _), v in cases.items():
        cost[f] += v[1]
    lines.append("Time per promise (summed test time, seconds): " + ", ".join(
        f"{p} {cost[contract.PROMISES[p]]:.1f}" for p in promises) + ".")
    lines.append("")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=ROOT, help="the tree whose ttt_zoo is tested (default: this repository)")
    ap.add_argument("--label", default=TODAY, help="the run's name (default: %(default)s)")
    ap.add_argument("-k", dest="select", default="", help="pytest -k expression (cells not selected: 'not run')")
    ap.add_argument("--render-only", action="store_true", help="render the kept runs without running the test")
    args = ap.parse_args(argv)
    if not args.render_only:
        run_tests(os.path.abspath(args.tree), args.label, args.select)
    contract = _contract()
    runs = sorted((f[:-4] for f in os.listdir(RUNS) if f.endswith(".xml")), key=lambda r: (r != TODAY, r))
    if TODAY not in runs:
        raise SystemExit(f"error: no run of today's tree in {RUNS}; run without --tree first")
    lines = [f"<!-- generated by experiments/registry_contract_table.py, at commit {_git(ROOT, 'rev-parse', '--short', 'HEAD')} -->",
             "# Registry contract: every registered model x every promise (issue 30, item 1)", "",
             f"From `{TEST}` (junit files in `results/registry_contract/`). Per-model promises run on every model; "
             f"the per-code-path ones ({', '.join(contract.PER_CODE_PATH)}) run on the smallest member of each code "
             "path (same class, same name but the size word) and the cell names it (`= rep`). n/a: the promise does "
             "not apply to the kind (" + "; ".join(f"{k}: {v}" for k, v in contract.NOT_APPLICABLE.items()) + "). "
             "The issue's other faults (recipes, docs, CLI, layouts), each with its fix reverted on today's tree, "
             "and the tests that then fail: `fault_reverts.md` (experiments/fault_reverts.py).",
             ""]
    for run in runs:
        title = "Today" if run == TODAY else f"Before the fixes: `{run}`"
        lines.extend(render(contract, os.path.join(RUNS, f"{run}.xml"), title))
    from ttt_zoo.fileio import atomic_write
    atomic_write(OUT, "\n".join(lines) + "\n")
    print(f"wrote {OUT}: runs {', '.join(runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
