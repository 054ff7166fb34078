"""The walk of a run folder: for each command that reads a run, the ttt_zoo source files on the Python stack whenever
the process opens or lists a path inside the run folder (an audit hook on ``open``, ``os.listdir``, ``os.scandir``).
Run against a checkout (``--tree``) in a child process per command, on a tiny run made by that checkout:

    git worktree add /tmp/W/before 299558e
    python experiments/run_folder_walk.py --tree /tmp/W/before --json /tmp/W/before.json
    python experiments/run_folder_walk.py --tree . --json /tmp/W/after.json
    python experiments/run_folder_walk.py --table /tmp/W/before.json /tmp/W/after.json   # -> results/run_folder_walk.md
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "experiments", "results", "run_folder_walk.md")
KW = ["depth=1", "embed_dim=16", "num_heads=2", "patch_size=4"]

CHILD = r'''
import json, os, sys, inspect
tree, run, argv, out = sys.argv[1], os.path.realpath(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
pkg = os.path.join(tree, "ttt_zoo") + os.sep
seen = set()
def hook(event, args):
    if event not in ("open", "os.listdir", "os.scandir") or not args or not isinstance(args[0], (str, bytes)):
        return
    p = os.fsdecode(args[0])
    if not os.path.realpath(os.path.abspath(p)).startswith(run):
        return
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if fn.startswith(pkg):
            seen.add(os.path.relpath(fn, tree))
        f = f.f_back
sys.addaudithook(hook)
from ttt_zoo.cli import main
try:
    rc = main(argv)
except SystemExit as e:
    rc = e.code
with open(out, "w") as f:
    json.dump({"rc": rc, "files": sorted(seen)}, f)
'''


def commands(run: str, work: str):
    return {
        "validate": ["validate", "--checkpoint", run, "-j", "0", "--device", "cpu"],
        "predict": ["predict", os.path.join(work, "digits", "val", "3"), "--checkpoint", run, "--device", "cpu",
                    "--model", "vit3_tiny", "--model-kwargs", *KW, "--img-size", "16"],
        "export": ["export", "--checkpoint", run, "--model", "vit3_tiny", "--model-kwargs", *KW, "num_classes=10",
                   "--img-size", "16", "16", "--out", os.path.join(work, "m.onnx")],
        "attention-map": ["attention-map", "--checkpoint", run, "--model", "vit3_tiny", "--model-kwargs", *KW,
                          "num_classes=10", "--img-size", "16", "--query-pixel", "3", "3", "--out",
                          os.path.join(work, "a.png")],
        "convert": ["convert", run, "--model", "vit3_tiny.walk", "--model-kwargs", *KW, "num_classes=10",
                    "img_size=16", "--out", os.path.join(work, "hub"), "--no-flops"],
        "train --resume": ["train", "--resume", run, "--epochs", "2"],
    }


def measure(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    work = tempfile.mkdtemp(prefix="walk-")
    py = sys.executable
    subprocess.run([py, "-c", "import sys; sys.path.insert(0, %r); from _train_data import make_tiny_digits; "
                    "make_tiny_digits('digits')" % os.path.join(ROOT, "tests")], cwd=work, env=env, check=True)
    subprocess.run([py, "-m", "ttt_zoo", "train", "--data-dir", "digits", "--output", "runs", "--experiment", "r",
                    "--model", "vit3_tiny", "--model-kwargs", *KW, "--img-size", "16", "--workers", "0", "-b", "8",
                    "--epochs", "1", "--warmup-epochs", "0", "--lr", "0.05"], cwd=work, env=env, check=True,
                   capture_output=True)
    run = os.path.join(work, "runs", "r")
    rows = {}
    for name, argv in commands(run, work).items():
        out = os.path.join(work, "walk.json")
        subprocess.run([py, "-c", CHILD, tree, run, json.dumps(argv), out], cwd=work, env=env, capture_output=True)
        with open(out) as f:
            rows[name] = json.load(f)
    return rows


def table(before: dict, after: dict) -> str:
    lines = ["# The walk of a run folder, before (299558e) and after",
             "",
             "ttt_zoo files on the Python stack whenever a command opens or lists a path inside the run folder "
             "(audit hook; `python experiments/run_folder_walk.py`, a 1-epoch vit3_tiny run, 2-core CPU VM).",
             "",
             "| command | before: files | after: files | after: the files |", "|---|---:|---:|---|"]
    for name in after:
        b, a = before.get(name, {}), after[name]
        lines.append(f"| `{name}` | {len(b.get('files', []))} (rc {b.get('rc')}) | {len(a['files'])} (rc {a['rc']}) "
                     f"| {', '.join(a['files'])} |")
    lines += ["", "Before, per command:", ""]
    lines += [f"- `{n}`: {', '.join(r['files'])}" for n, r in before.items()]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree")
    ap.add_argument("--json")
    ap.add_argument("--table", nargs=2)
    a = ap.parse_args()
    if a.table:
        before, after = (json.load(open(p)) for p in a.table)
        with open(OUT, "w") as f:
            f.write(table(before, after))
        return
    rows = measure(a.tree)
    with open(a.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
