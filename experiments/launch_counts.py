"""Launches per block and per ``ttt_zoo::`` op, Triton and torch paths, for every code path (the tiny classifiers,
their variants, DiT3-S/2 and DiT5-S/2) and timm's DeiT-T (``ttt_zoo.bench.launches``; the first block at the
smallest input size its strides allow, batch 2, CPU; Triton under ``TRITON_INTERPRET=1``).  The torch path is also
counted at the model's own input size (224 px; 32-px latents for DiT), where a Python loop shows, and every block
again under CPU bf16 autocast (Triton launched, not run), where autocast's casts are launches too.

    TRITON_INTERPRET=1 python experiments/launch_counts.py --json experiments/results/launch_counts.json \
        --before experiments/results/launch_counts_before.json --md experiments/results/launch_counts.md
    # --launch-only: Triton kernels launched, not run (seconds instead of ~25 min; the same counts)
    # the "before" numbers: the same counter over an older checkout's package
    git worktree add /tmp/wt299558e 299558e
    TRITON_INTERPRET=1 python experiments/launch_counts.py --tree /tmp/wt299558e \
        --json experiments/results/launch_counts_before.json
    git worktree remove /tmp/wt299558e

Each row is written to the JSON file as it is measured (atomically), so a killed run keeps its finished rows;
``--resume`` keeps the rows already in ``--json`` and measures the rest.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
HERE = Path(__file__).resolve().parent
PEER = "deit_tiny_patch16_224"
PATHS = ("torch", "triton")


def _counter():
    """This checkout's counter (``ttt_zoo/bench/launches.py``), loaded by path so that ``--tree`` counts another
    checkout's package with the same counter."""
    spec = importlib.util.spec_from_file_location("launch_counter", HERE.parent / "ttt_zoo" / "bench" / "launches.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(name: str, backend: str, counter, full_size: bool, run_triton: bool) -> dict:
    import timm
    import torch
    from ttt_zoo.kernels.backend import BackendError, use_backend

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with use_backend(backend):
        model = timm.create_model(name, **({"img_size": 32} if name == PEER else {}))
        size = counter.smallest_img_size(model)
        try:
            infer, train = counter.block_launches(model, img_size=size, run_triton=run_triton)
            full = counter.block_launches(model, img_size=model.pretrained_cfg["input_size"][-1]) \
                if full_size else None
            with torch.autocast("cpu", dtype=torch.bfloat16):  # as a GPU user trains: autocast's casts count
                bf16 = counter.block_launches(model, img_size=size, run_triton=False)
        except BackendError as e:
            return {"model": name, "path": backend, "img_size": size, "error": str(e).split(". ")[0]}
    row = {"model": name, "path": backend, "img_size": size, "triton_run": run_triton,
           "infer_aten": infer.aten_total, "infer_triton": infer.triton_total,
           "train_aten": train.aten_total, "train_triton": train.triton_total,
           "infer_shared": infer.shared, "train_shared": train.shared,
           "infer_by_op": dict(infer.by_op), "train_by_op": dict(train.by_op),
           "infer_ops": dict(infer.aten.most_common()), "train_ops": dict(train.aten.most_common()),
           "infer_triton_kernels": dict(infer.triton), "train_triton_kernels": dict(train.triton)}
    row.update(infer_bf16=bf16[0].total, train_bf16=bf16[1].total, train_bf16_casts=bf16[1].aten["_to_copy"])
    if full:
        row.update(full_size=model.pretrained_cfg["input_size"][-1], infer_full=full[0].total, train_full=full[1].total)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _write(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def total(r, kind):
    return r[f"{kind}_aten"] + r[f"{kind}_triton"] + r.get(f"{kind}_shared", 0)


def get(rows, model, path):
    return next((r for r in rows or [] if r["model"] == model and r["path"] == path), None)


def _cell(r, kind):
    if r is None:
        return "-"
    if "error" in r:
        return "n/a"
    shared = f" + {r[f'{kind}_shared']}" if r.get(f"{kind}_shared") else ""
    return f"{total(r, kind)} ({r[f'{kind}_aten']} + {r[f'{kind}_triton']}{shared})" \
        if r[f"{kind}_triton"] or shared else str(total(r, kind))


def _run_note(rows, which):
    ran = {r.get("triton_run", True) for r in rows or [] if r["path"] == "triton"}
    return f"{which}: " + ("run (interpreter)" if ran == {True} else "launched, not run" if ran == {False} else "mixed")


def markdown(rows, before, commit, before_name) -> str:
    peer = get(rows, PEER, "torch")
    pi, pt = total(peer, "infer"), total(peer, "train")
    lines = [f"<!-- generated by experiments/launch_counts.py at commit {commit} -->",
             "# Launches per block (issues 39, 48): inference and one training step (forward + backward)", "",
             "The first block of each model at the smallest input its strides allow (`size`: a 2x2 token map at the",
             "coarsest stage, the model's minimum, a neighbourhood window that fits; DiT: latent px), batch 2, on the",
             "CPU, counted by `ttt_zoo.bench.launches` at the dispatcher: kernel-launching aten ops (views and",
             "allocations are not launches) + Triton launches (under `TRITON_INTERPRET=1`). `a + t`: aten ops + Triton",
             "kernels; `a + t + s`: DiT blocks also count `s`, their share of the model's one conditioning GEMM for",
             "all blocks (`DiT.modulations`: its launches divided by the depth, rounded up).",
             f"Before: {before_name}, counted by this counter. x DeiT: to timm's DeiT-T block counted the same",
             f"way ({pi} / {pt}); the issue-48 target on the Triton path is <= 1.5x in inference ({int(1.5 * pi)}) and",
             f"<= 1.3x in training ({int(1.3 * pt)}). n/a: the path cannot run the op (the reason in the JSON file).",
             "`torch @ full`: the torch path at the model's own input size (224 px, DiT 32-px latents), where a",
             "Python loop over mini-batches or tiles shows. Triton kernels: "
             f"{_run_note(before, 'before')}; {_run_note(rows, 'after')} (the same counts: "
             "tests/test_launch_counts.py).",
             "`bf16 autocast`: the same block and step under `torch.autocast('cpu', torch.bfloat16)` (Triton kernels",
             "launched, not run), as a GPU user trains: autocast's casts are launches too (`casts`: the step's",
             f"`_to_copy`); DeiT-T: {peer.get('infer_bf16', '-')} / {peer.get('train_bf16', '-')}.", "",
             "| model | path | size | inference before | inference after | x DeiT | training before | training after "
             "| x DeiT | bf16 autocast inference / training (casts) | x DeiT | torch @ full before | torch @ full after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = get(before, r["model"], r["path"])
        ratio = lambda k, p: "-" if "error" in r else f"{total(r, k) / p:.2f}"  # noqa: E731
        full = lambda x: f"{x['infer_full']} / {x['train_full']}" if x and "infer_full" in x else "-"  # noqa: E731
        bf16, bf16_x = "-", "-"
        if "train_bf16" in r:
            bf16 = f"{r['infer_bf16']} / {r['train_bf16']} ({r['train_bf16_casts']})"
            bf16_x = f"{r['infer_bf16'] / peer['infer_bf16']:.2f} / {r['train_bf16'] / peer['train_bf16']:.2f}"
        lines.append(f"| {r['model']} | {r['path']} | {r['img_size']} | {_cell(b, 'infer')} | {_cell(r, 'infer')} "
                     f"| {ratio('infer', pi)} | {_cell(b, 'train')} | {_cell(r, 'train')} | {ratio('train', pt)} "
                     f"| {bf16} | {bf16_x} | {full(b)} | {full(r)} |")
    lines += ["", "## Launches inside each `ttt_zoo::` op (Triton path), per block", "",
              "| model | op | inference before | inference after | training before | training after |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r["path"] != "triton" or "error" in r:
            continue
        b = get(before, r["model"], "triton")
        ops = sorted(set(r["train_by_op"]) | set((b or {}).get("train_by_op", {})))
        for op in ops:
            val = lambda x, k: "-" if x is None or "error" in x else x[f"{k}_by_op"].get(op, 0)  # noqa: E731
            lines.append(f"| {r['model']} | {op} | {val(b, 'infer')} | {val(r, 'infer')} | {val(b, 'train')} | "
                         f"{val(r, 'train')} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="rows, written as measured")
    ap.add_argument("--md", type=Path, help="the markdown table (needs every row in --json)")
    ap.add_argument("--before", type=Path, help="a JSON file of this script over an earlier checkout (--tree)")
    ap.add_argument("--tree", type=Path, help="count the package of this checkout (e.g. a git worktree)")
    ap.add_argument("--models", nargs="*", help="default: DeiT-T and every code path")
    ap.add_argument("--paths", nargs="*", default=list(PATHS), choices=PATHS)
    ap.add_argument("--launch-only", action="store_true",
                    help="launch the Triton kernels without running them (the same counts: tests/test_launch_counts.py)")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --json")
    ap.add_argument("--md-only", action="store_true", help="write --md from --json without measuring")
    args = ap.parse_args()
    if args.tree:
        sys.path.insert(0, str(args.tree.resolve()))
    import torch
    import ttt_zoo
    print("package:", Path(ttt_zoo.__file__).parent, flush=True)
    torch.set_num_threads(1)
    counter = _counter()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=args.tree or HERE).stdout.strip()
    rows = json.loads(args.json.read_text()) if (args.resume or args.md_only) and args.json.exists() else []
    if not args.md_only:
        for name in args.models or [PEER] + counter.code_paths(include_diffusion=True):
            for backend in ("torch",) if name == PEER else args.paths:
                if get(rows, name, backend):
                    continue
                rows.append({**measure(name, backend, counter, full_size=backend == "torch" and name != PEER,
                                     run_triton=not args.launch_only),
                             "commit": commit})
                _write(args.json, json.dumps(rows, indent=1))
                print(name, backend, _cell(rows[-1], "infer"), _cell(rows[-1], "train"),
                      f"{rows[-1].get('seconds', '-')} s", flush=True)
    if args.md:
        before = json.loads(args.before.read_text()) if args.before else None
        before_name = f"`{args.before.name}`" if args.before else "-"
        if before:
            before_name += f" (commit {before[0].get('commit', '?')})"
        _write(args.md, markdown(rows, before, commit, before_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
