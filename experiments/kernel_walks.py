"""The kernel walks of issue 47, measured: how many repository source files one op call crosses.

For one small model of each family (``MODELS``), built with ``timm.create_model`` from the checkout ``--tree`` and
run forward once in training mode on the CPU under ``TRITON_INTERPRET=1`` (a child process per model and setting):

(a) **model name to kernel**, per op folder whose kernels the model launches: the distinct repository files (under
    ``ttt_zoo/`` or ``kernels/``) on the Python call stack at the moment ``timm.create_model`` enters the model's
    registered entrypoint, united with those on the stack at every Triton kernel launch (``InterpretedFunction.run``)
    of the forward whose innermost ``kernels/<folder>/`` frame is that folder, with ``backend='triton'``.  The table
    shows the largest folder's count per model.
(b) **backend choice**: for every call of a ``kernels/api.py`` wrapper (entered from outside ``api.py``), the
    distinct repository files of the functions called from the wrapper's entry until the last return of a path
    decision inside that call.  A path decision is a call of a function named in ``DECISIONS`` (backend resolution,
    the Triton checks, ``kernel_choice``, ``choose``, ...), or of a predicate in ``PREDICATES`` (export, compile,
    autograd needed) made directly by a function in ``DECIDERS`` (the functions that pick a path from it: the api
    wrappers, the choosers, the PyTorch paths that switch between their algorithms); the same predicate called
    inside the compute (e.g. RoPE's real-or-complex form under export) is no path decision.  Counted for
    ``backend='triton'`` and ``backend='torch'``, united per wrapper; the table shows the largest wrapper's count.

Compute that runs before the last decision of a call (argument checks, RoPE, stacking of the scan directions) counts
in (b): it is what a reader crosses before knowing which path runs.  The backward pass is not walked.

    git worktree add /tmp/wt299 299558e
    python experiments/kernel_walks.py --tree /tmp/wt299 --json /tmp/walks_before.json
    python experiments/kernel_walks.py --tree . --json /tmp/walks_after.json
    python experiments/kernel_walks.py --table /tmp/walks_before.json /tmp/walks_after.json
    git worktree remove /tmp/wt299
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_MD = os.path.join(ROOT, "experiments", "results", "kernel_walks.md")
OUT_JSON = os.path.join(ROOT, "experiments", "results", "kernel_walks.json")
# one small model per family: registry name -> create_model kwargs
MODELS = {
    "vit3_tiny": dict(depth=1, img_size=32, num_classes=10),
    "hvit3_tiny": dict(depths=(1, 1, 1, 1), img_size=64, num_classes=10),
    "t5_tiny": dict(depth=1, img_size=32, num_heads=6, num_classes=10),  # d = 32: the T5 kernel's limit
    "visionttt_tiny": dict(depth=1, img_size=32, num_classes=10),
    "dit5_s_2": dict(depth=1, input_size=8, num_classes=10),
}
DECISIONS = ["resolve_backend", "get_op", "default_backend", "triton_unsupported", "kernel_choice", "gpu_verified",
             "verified", "choose", "qkv_custom_op", "_opaque_scan", "_op", "triton_choice"]
PREDICATES = ["exporting", "needs_grad", "_needs_grad", "compiling", "_compiling"]
DECIDERS = ["choose", "qkv_custom_op", "torch_algorithm", "ttt_linear_torch", "ttt_linear_bidir_torch", "qkv_ttt_torch",
            "run_variant", "ttt_linear_op", "ttt_linear_bidir_op", "qkv_ttt_op", "_opaque_scan"]  # + every function of api.py

CHILD = r'''
import json, os, sys
tree, name, kwargs, backend, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
sys.path.insert(0, tree)
roots = tuple(os.path.join(tree, d) + os.sep for d in ("ttt_zoo", "kernels"))
api_file = os.path.join(tree, "kernels", "api.py")
DECISIONS, PREDICATES, DECIDERS = (set(x) for x in json.loads(sys.argv[6]))
import torch, timm
import triton.runtime.interpreter as TI
import ttt_zoo
from ttt_zoo.kernels import backend as B

def rel(fn):
    fn = os.path.abspath(fn)
    return os.path.relpath(fn, tree) if fn.startswith(roots) else None

def stack_files(frame):
    files = set()
    while frame is not None:
        r = rel(frame.f_code.co_filename)
        if r:
            files.add(r)
        frame = frame.f_back
    return files

walk_a, per_folder, launches, choice = set(), {}, [0], {}
kernels_dir = os.path.join(tree, "kernels") + os.sep
state = {"api": None, "files": set(), "last": None, "name": None}

def profile(frame, event, arg):
    if event not in ("call", "return"):
        return
    code = frame.f_code
    fn = code.co_filename
    if event == "call":
        if state["api"] is None:
            if fn == api_file and (frame.f_back is None or frame.f_back.f_code.co_filename != api_file):
                state.update(api=frame, files={"kernels/api.py"}, last=None, name=code.co_name)
            elif rel(fn) and frame.f_back is not None and "timm" in frame.f_back.f_code.co_filename \
                    and "create_model" in frame.f_back.f_code.co_name:
                walk_a.update(stack_files(frame))
            return
        r = rel(fn)
        if r:
            state["files"].add(r)
    else:
        if state["api"] is None:
            return
        if rel(fn) and (code.co_name in DECISIONS or code.co_name in PREDICATES and frame.f_back is not None and (
                frame.f_back.f_code.co_name in DECIDERS or frame.f_back.f_code.co_filename == api_file)):
            state["last"] = set(state["files"])
        if frame is state["api"]:
            choice.setdefault(state["name"], set()).update(state["last"] or {"kernels/api.py"})
            state["api"] = None

run = TI.InterpretedFunction.run
def counted_run(self, *args, **kw):
    frame = sys._getframe(1)
    files = stack_files(frame)
    while frame is not None and not (frame.f_code.co_filename.startswith(kernels_dir)
                                     and os.sep in os.path.relpath(frame.f_code.co_filename, kernels_dir)):
        frame = frame.f_back
    folder = os.path.relpath(frame.f_code.co_filename, kernels_dir).split(os.sep)[0] if frame else "?"
    per_folder.setdefault(folder, set()).update(files)
    launches[0] += 1
    sys.setprofile(None)
    try:
        return run(self, *args, **kw)
    finally:
        sys.setprofile(profile)
TI.InterpretedFunction.run = counted_run

torch.manual_seed(0)
sys.setprofile(profile)
model = timm.create_model(name, **kwargs)
sys.setprofile(None)
model.train()
with B.use_backend(backend):
    sys.setprofile(profile)
    if name.startswith("dit"):
        s = kwargs.get("input_size", 8)
        y = model(torch.randn(1, 4, s, s), torch.tensor([10.0]), torch.tensor([1]))
    else:
        s = kwargs.get("img_size", 32)
        y = model(torch.randn(1, 3, s, s))
    sys.setprofile(None)
json.dump({"walk_a": {f: sorted(walk_a | v) for f, v in per_folder.items()}, "launches": launches[0],
           "choice": {k: sorted(v) for k, v in choice.items()}}, open(out, "w"))
'''


def measure(tree: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.path.abspath(tree))
    result = {"tree": os.path.abspath(tree), "commit": subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "models": {}}
    for name, kwargs in MODELS.items():
        row = {}
        for backend in ("triton", "torch"):
            out = f"/tmp/kernel_walk_{os.getpid()}.json"
            p = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(tree), name, json.dumps(kwargs), backend,
                                out, json.dumps([DECISIONS, PREDICATES, DECIDERS])], env=env, capture_output=True, text=True,
                               cwd=tree)
            if p.returncode:
                raise SystemExit(f"error: {name} with backend={backend} failed in {tree}:\n{p.stderr[-3000:]}")
            with open(out) as f:
                row[backend] = json.load(f)
            os.unlink(out)
        choice = {}
        for backend in ("triton", "torch"):
            for op, files in row[backend]["choice"].items():
                choice.setdefault(op, set()).update(files)
        op = max(sorted(choice), key=lambda o: len(choice[o]))
        walks = row["triton"]["walk_a"]
        folder = max(sorted(walks), key=lambda f: len(walks[f]))
        result["models"][name] = {"walk_a_per_folder": walks, "walk_a_max_folder": folder, "walk_a": walks[folder],
                                  "launches": row["triton"]["launches"],
                                  "choice": {o: sorted(f) for o, f in choice.items()}, "choice_max_op": op,
                                  "choice_max": sorted(choice[op])}
        print(name, {f: len(w) for f, w in walks.items()}, "files to the kernel,", len(choice[op]), "for the choice",
              flush=True)
    return result


def table(before: dict, after: dict) -> str:
    lines = [f"<!-- generated by experiments/kernel_walks.py at commit {after['commit']} -->",
             "# The kernel walks (issue 47): files one op call crosses, before and after", "",
             f"Before: {before['commit']}; after: {after['commit']}.  Definitions: the docstring of "
             "`experiments/kernel_walks.py` ((a) the files on the stack from `timm.create_model` to each Triton launch "
             "of one forward, `backend='triton'`, `TRITON_INTERPRET=1`; (b) the files executed from an `api.py` "
             "wrapper's entry to the last path decision of that call, the largest wrapper of the model).", "",
             "| model | (a) name to kernel, before | after | (b) backend choice, before | after | launches before / after |",
             "|---|---|---|---|---|---|"]
    for name in after["models"]:
        b, a = before["models"][name], after["models"][name]
        lines.append(f"| `{name}` | {len(b['walk_a'])} | {len(a['walk_a'])} | {len(b['choice_max'])} "
                     f"(`{b['choice_max_op']}`) | {len(a['choice_max'])} (`{a['choice_max_op']}`) | "
                     f"{b['launches']} / {a['launches']} |")
    lines += ["", "## The files", ""]
    for name in after["models"]:
        b, a = before["models"][name], after["models"][name]
        lines += [f"### `{name}`", "",
                  f"- (a) before: {', '.join(f'`{f}`' for f in b['walk_a'])}",
                  f"- (a) after: {', '.join(f'`{f}`' for f in a['walk_a'])}",
                  f"- (b) before (`{b['choice_max_op']}`): {', '.join(f'`{f}`' for f in b['choice_max'])}",
                  f"- (b) after (`{a['choice_max_op']}`): {', '.join(f'`{f}`' for f in a['choice_max'])}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", help="checkout to measure")
    ap.add_argument("--json", help="write the measurement here")
    ap.add_argument("--table", nargs=2, metavar=("BEFORE", "AFTER"), help="write results/kernel_walks.{md,json}")
    args = ap.parse_args()
    if args.table:
        with open(args.table[0]) as f:
            before = json.load(f)
        with open(args.table[1]) as f:
            after = json.load(f)
        with open(OUT_MD, "w") as f:
            f.write(table(before, after) + "\n")
        with open(OUT_JSON, "w") as f:
            json.dump({"before": before, "after": after}, f, indent=1)
        print(f"wrote {OUT_MD} and {OUT_JSON}")
        return
    if not args.tree or not args.json:
        raise SystemExit("error: give --tree and --json (or --table BEFORE AFTER); see --help")
    with open(args.json, "w") as f:
        json.dump(measure(args.tree), f, indent=1)


if __name__ == "__main__":
    main()
