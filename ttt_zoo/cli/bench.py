"""``ttt-zoo bench``: time and peak memory of models (and peers from timm) across image sizes, of the TTT ops
(``--ops``), or an operator profile (``--profile``); flags and result keys follow timm's ``benchmark.py``.

    ttt-zoo bench --model vit3_tiny --peers deit_tiny_patch16_224 --img-size 224 512 1024 --output out/
    ttt-zoo bench --model vit3_tiny --backend torch_naive torch --bench train --img-size 224 384x320 -b 8
    ttt-zoo bench --ops vit3_swiglu_ttt ttt_linear_bidir --device cuda --output out/
    ttt-zoo bench --ops t5_swiglu_ttt --dry-run            # tiny shapes on the CPU, Triton in the interpreter
    PYTHONPATH=dev ttt-zoo bench --import my_models --model vit3_tiny --peers my_vit_tiny --img-size 224
    ttt-zoo bench --profile --model vit3_tiny --peers deit_tiny_patch16_224 --img-size 1024 --output out/
"""

import argparse
import ast
import importlib
import os
import shlex
import sys

from ttt_zoo.flags import BACKENDS, Range, SizeRange, model_kwargs_problem
from ttt_zoo.torchcompile import add_torchcompile_args, check_torchcompile

__all__ = ["add_parser", "run", "parse_img_size"]


parse_img_size = SizeRange()  # ``224`` -> (224, 224); ``384x320`` -> (384, 320) (height x width)


def _kwarg(text: str):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    try:
        v = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        pass  # a plain string
    why = model_kwargs_problem({k: v})
    if why:
        raise argparse.ArgumentTypeError(why)
    return k, v


def _resolve_models(p: argparse.ArgumentParser, names, flag: str):
    """Registered names, timm wildcards (``vit3_*``) expanded; an unknown name is a usage error."""
    import timm
    import ttt_zoo  # noqa: F401  (registers the models)
    from ttt_zoo.registry import resolve_model_name
    out = []
    for n in names:
        found = timm.list_models(n) if any(c in n for c in "*?[") else []
        if not found:
            try:
                found = [resolve_model_name(n, flag=flag)]
            except ValueError as e:
                p.error(str(e))
        out += found
    return out


def _write_md(path: str, title: str, cmd: str, machine: str, protocol: str, body: str) -> None:
    from ttt_zoo.fileio import atomic_write
    atomic_write(path, f"# {title}\n\n`{cmd}`\n\nMachine: {machine}.\n\n{protocol}\n\n{body}\n")


PROFILE_NOTE = ("On CUDA the rows are the device's kernels and copies, each counted once (as torch's table's \"Self "
                "CUDA time total\"); GPU busy = device time / wall time of the profiled step; fp32 share = kernel "
                "time in kernels whose name says float32 (cuBLAS/CUTLASS f32/tf32/sgemm, ATen's <float>); unnamed = "
                "kernels whose name gives no type (Triton's). On the CPU the rows are the operators' self CPU time.")


def _profile_text(profiles) -> str:
    body = []
    for r in profiles:
        body.append(f"## {r['label']} @ {r['img_size']}, {r['phase']}: " + (
            f"failed: {r['error']}" if "error" in r else f"{r['total_ms']:.1f} ms self {r.get('time', 'cpu')} "
                                                         f"time per step"))
        if r.get("busy_pct") is not None:
            share = (lambda k: "-" if r.get(k) is None else f"{r[k]:.1f}%")
            body += ["", f"GPU busy {r['busy_pct']:.1f}% of a {r['wall_ms']:.2f} ms step; {r['kernels']:.0f} kernels "
                         f"and {r['copies']:.0f} copies per step; copies {r['copy_ms']:.3f} ms; kernel time in fp32 "
                         f"kernels {share('fp32_share')}, half precision {share('half_share')}, unnamed "
                         f"{share('unknown_dtype_share')}."]
        if "ops" in r:
            body += ["", "| operator | ms / step | share | calls / step |", "|---|---:|---:|---:|"]
            body += [f"| `{o['op']}` | {o['ms']:.2f} | {o['share']:.1f}% | {o['calls']} |" for o in r["ops"]]
        body.append("")
    return "\n".join(body)


def _check_outputs(args) -> None:
    """Refuse to overwrite --results-file or the files of --output without --force, before measuring."""
    from ._common import check_out, check_out_folder
    if args.results_file:
        check_out(args.results_file, args.force, "--results-file")
    if args.output:
        names = (["profile.md", "profile.json"] if args.profile else ["ops.md"] if args.ops is not None
                 else ["bench.md", "bench.png"])
        check_out_folder(args.output, names + ([] if args.results_file or args.profile else ["results.csv"]),
                         args.force)


def run(args) -> int:
    from ttt_zoo.bench import (BenchConfig, format_ops_table, format_table, plot_results, run_models, run_ops,
                               run_profiles, write_results)
    from ttt_zoo.bench.report import spread_warning
    from ttt_zoo.bench.measure import describe_machine, machine_info
    import torch
    p = args._parser
    _check_outputs(args)  # first: an output in a run folder is refused whatever else is wrong
    if args.device.startswith("cuda") and not args.dry_run and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here; use --device cpu (or --ops ... --dry-run)")
    if args.results_file and os.path.splitext(args.results_file)[1].lower() not in (".csv", ".json"):
        p.error(f"--results-file {args.results_file!r}: the name must end in .csv or .json")
    cmd = "ttt-zoo bench " + " ".join(shlex.quote(a) for a in args._argv)
    machine = machine_info("cpu" if args.dry_run else args.device, args.threads)
    results_file = args.results_file or (os.path.join(args.output, "results.csv") if args.output else None)

    if args.ops is not None:
        from ttt_zoo.bench.ops import OPS
        from ttt_zoo.kernels import available_ops
        known = sorted(available_ops())
        ops = args.ops or known
        bad = [o for o in ops if o not in known]
        if bad:
            p.error(f"--ops: unknown op(s) {bad}; registered: {known}")
        missing = [o for o in ops if o not in OPS]
        if missing:
            p.error(f"--ops: no benchmark shapes defined for {missing} (add them to ttt_zoo/bench/ops.py OPS)")
        backends = [b for b in (args.backend or ["triton", "torch", "torch_naive"]) if b != "auto"]
        if not backends:
            p.error("--ops measures named backends: give --backend triton, torch and/or torch_naive")
        device, dtype = ("cpu", "float32") if args.dry_run else (args.device, args.dtype)
        warm, iters = (0, 1) if args.dry_run else (args.num_warm_iter, args.num_bench_iter)
        rows = run_ops(ops, device, dtype, backends, warm, iters, dry_run=args.dry_run, threads=args.threads)
        table = format_ops_table(rows)
        print(table)
        if results_file:
            write_results(results_file, rows, machine)
        if args.output:
            _write_md(os.path.join(args.output, "ops.md"), "TTT ops: " + ("DRY RUN (CPU, tiny shapes, Triton "
                      "interpreter)" if args.dry_run else f"{device}, {dtype}"), cmd, describe_machine(machine),
                      f"Median of {iters} calls after {warm} warm-ups; peak = memory growth during the calls "
                      "(inputs excluded). Diffs are against `torch_naive` in fp32 on the same inputs.", table)
        return 1 if any("error" in r for r in rows) else 0

    for module in args.imports:
        try:
            importlib.import_module(module)
        except ImportError as e:
            p.error(f"--import {module}: cannot import it ({e}); put its folder on PYTHONPATH")
    models = _resolve_models(p, args.model_list_names or args.model, "--model")
    peers = _resolve_models(p, args.peers, "--peers")
    before = None
    if args.before:
        from ttt_zoo.bench.run import export_revision
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            before = (args.before, export_revision(root, args.before))
        except ValueError as e:
            p.error(str(e))
    cfg = BenchConfig(models=models, peers=peers, img_sizes=args.img_size,
                      phases={"inference": ("infer",), "train": ("train",), "both": ("infer", "train")}[args.bench],
                      batch_size=args.batch_size, batch_tokens=args.batch_tokens, device=args.device,
                      amp_dtype=args.amp_dtype if args.amp else None, channels_last=args.channels_last,
                      grad_checkpointing=args.grad_checkpointing, torchcompile=args.torchcompile,
                      torchcompile_mode=args.torchcompile_mode, num_warm_iter=args.num_warm_iter,
                      num_bench_iter=args.num_bench_iter, threads=args.threads, backends=args.backend or [None],
                      runtimes=tuple(dict.fromkeys(args.runtime)),
                      model_kwargs=dict(args.model_kwargs or []),
                      set_attr=dict(args.set_attr or []), saved_mem=args.saved_mem, repeats=args.repeats,
                      before=before, top=args.profile_top, imports=tuple(args.imports), malloc_trim=args.malloc_trim)
    protocol = (f"{'Profile' if args.profile else 'Benchmark'}: every (model, size, phase) in a fresh subprocess, "
                f"all side by side in this run; {cfg.num_warm_iter} warm-up + {cfg.num_bench_iter} timed steps, "
                "step time = median of the timed steps of every repeat, with their min-max (the spread); "
                f"precision {'autocast ' + cfg.amp_dtype if cfg.amp_dtype else 'float32'}"
                f"{', channels-last' if cfg.channels_last else ''}"
                f"{', gradient checkpointing' if cfg.grad_checkpointing else ''}"
                f"{', torch.compile ' + cfg.torchcompile if cfg.torchcompile else ''}"
                f"{' (mode ' + cfg.torchcompile_mode + ')' if cfg.torchcompile_mode else ''}; batch "
                f"{f'max(1, {cfg.batch_tokens} tokens / (H/16 x W/16))' if cfg.batch_tokens else cfg.batch_size}. "
                "Inference: eval, no_grad. Train: forward + cross-entropy + backward (no optimizer step). "
                "Peak memory: growth over the loaded model and input during the steps ("
                + ("torch.cuda.max_memory_allocated" if cfg.device.startswith("cuda") else "peak RSS, VmHWM"
                   + ("; glibc MALLOC_TRIM_THRESHOLD_=0: freed memory returned at once, so it follows the live tensors"
                      if cfg.malloc_trim else "")) + "). "
                "Ratios: this row / each peer's row at the same size, from this one run's medians; a time ratio "
                "whose two min-max ranges overlap is marked * (not meaningful).")
    if args.profile:
        def write_profiles(profiles):  # after every row: a killed run keeps the finished ones
            if args.output:
                _write_md(os.path.join(args.output, "profile.md"), "Operator profile", cmd, describe_machine(machine),
                          protocol + " The profiler adds overhead per operator: compare shares, not absolute times. "
                          + PROFILE_NOTE, _profile_text(profiles))
                write_results(os.path.join(args.output, "profile.json"), profiles, machine)  # unrounded values

        profiles = run_profiles(cfg, on_rows=write_profiles)
        print(_profile_text(profiles))
        return 1 if any("error" in r for r in profiles) else 0

    def write_rows(rows):  # after every measurement: a killed run keeps the finished rows
        if results_file:
            write_results(results_file, rows, machine)
        if args.output:
            _write_md(os.path.join(args.output, "bench.md"), "ttt-zoo bench", cmd, describe_machine(machine),
                      protocol, format_table(rows))

    rows = run_models(cfg, on_rows=write_rows)
    table = format_table(rows)
    print(table)
    write_rows(rows)
    warning = spread_warning(rows)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if results_file:
        print(f"wrote {results_file}")
    if args.output:
        if plot_results(rows, os.path.join(args.output, "bench.png"), describe_machine(machine)):
            print(f"wrote {os.path.join(args.output, 'bench.png')}")
        print(f"wrote {os.path.join(args.output, 'bench.md')}")
    failed = [r for r in rows if any(f"{p}_error" in r for p in ("infer", "train"))]  # not a missing GMACs count
    if failed:
        print(f"{len(failed)} configuration(s) failed; see the table", file=sys.stderr)
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time and peak memory of models / TTT ops across image sizes, side by side",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to measure")
    g.add_argument("--model", "-m", nargs="+", default=["vit3_tiny"], metavar="NAME",
                   help="zoo or timm model name(s) or wildcard (default: vit3_tiny)")
    g.add_argument("--model-list", default=None, metavar="FILE", help="text file with one model name per line")
    g.add_argument("--peers", nargs="+", default=[], metavar="NAME",
                   help="timm models measured alongside (e.g. deit_tiny_patch16_224); every row gets its ratios to each")
    g.add_argument("--bench", default="both", choices=["inference", "train", "both"])
    g.add_argument("--img-size", nargs="+", type=parse_img_size, default=[(224, 224)], metavar="SIZE",
                   help="one or more sizes: 224 or HEIGHTxWIDTH (384x320)")
    g.add_argument("-b", "--batch-size", type=Range(int, ge=1, le=65536), default=1)
    g.add_argument("--batch-tokens", type=Range(int, ge=1, le=1_000_000_000), default=None, metavar="N",
                   help="instead of -b: batch = max(1, N // (H/16 * W/16)), the same tokens at every size")
    g.add_argument("--backend", nargs="+", choices=BACKENDS, default=None,
                   help="TTT op backend(s) (set_backend in the child); several: each is measured")
    g.add_argument("--model-kwargs", nargs="+", type=_kwarg, metavar="KEY=VALUE", help="passed to create_model")
    g.add_argument("--set-attr", nargs="+", type=_kwarg, metavar="KEY=VALUE",
                   help="set this attribute on every submodule of --model that has it (e.g. recompute=False)")
    g.add_argument("--import", dest="imports", nargs="+", default=[], metavar="MODULE",
                   help="import these modules first, here and in every child: a module that registers models with "
                        "timm's @register_model makes them names for --model / --peers (e.g. a local peer)")
    g.add_argument("--before", default=None, metavar="REV",
                   help="also measure --model with the ttt_zoo code of this git revision")
    g = p.add_argument_group("how")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--threads", type=Range(int, ge=1, le=1024), default=None, help="torch CPU threads in each child")
    g.add_argument("--amp", action="store_true", help="autocast mixed precision")
    g.add_argument("--amp-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    g.add_argument("--channels-last", action="store_true")
    g.add_argument("--grad-checkpointing", action="store_true",
                   help="train with activation checkpointing (model.set_grad_checkpointing(), every row)")
    add_torchcompile_args(g, "torch.compile mode of the compiled rows (reduce-overhead: CUDA graphs)")
    g.add_argument("--runtime", nargs="+", default=["torch"], choices=["torch", "compile", "onnxruntime"],
                   help="side by side: torch (eager; alone, --torchcompile compiles it), compile (torch.compile with "
                        "--torchcompile's backend, default inductor) and/or onnxruntime (the `ttt-zoo export` graph, "
                        "CPU inference)")
    g.add_argument("--num-warm-iter", type=Range(int, ge=0, le=1_000_000), default=2)
    g.add_argument("--num-bench-iter", type=Range(int, ge=1, le=1_000_000), default=10)
    g.add_argument("--repeats", type=Range(int, ge=1, le=1000), default=1,
                   help="fresh subprocesses per config (median), interleaved")
    g.add_argument("--saved-mem", action="store_true", help="train: also MB of tensors saved for the backward")
    g.add_argument("--malloc-trim", action="store_true",
                   help="CPU: glibc returns freed memory at once in every child (MALLOC_TRIM_THRESHOLD_=0), so the "
                        "peak RSS follows the live tensors, as CUDA's max_memory_allocated, not glibc's retained heap")
    g = p.add_argument_group("modes and outputs")
    g.add_argument("--ops", nargs="*", default=None, metavar="OP",
                   help="op-level benchmark of these TTT ops (none listed: every op) instead of models")
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"], help="--ops dtype")
    g.add_argument("--dry-run", action="store_true", help="--ops: tiny shapes on the CPU, Triton in the interpreter")
    g.add_argument("--profile", action="store_true", help="torch.profiler operator breakdown instead of timings")
    g.add_argument("--profile-top", type=Range(int, ge=1, le=1_000_000), default=12)
    g.add_argument("--results-file", default=None, metavar="FILE", help=".csv or .json (timm's infer_/train_ keys)")
    g.add_argument("--output", default=None, metavar="DIR", help="folder for bench.md, bench.png, results.csv")
    g.add_argument("--force", action="store_true", help="replace an existing --results-file or --output files")
    p.set_defaults(func=_main, _parser=p)


def _main(args) -> int:
    import torch
    args._argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        args._parser.error(f"--device {args.device!r}: use cpu or cuda")
    args.model_list_names = None
    if args.model_list:
        try:
            with open(args.model_list) as f:
                args.model_list_names = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
        except OSError as e:
            args._parser.error(f"--model-list: cannot read {args.model_list!r} ({e.strerror})")
        if not args.model_list_names:
            args._parser.error(f"--model-list {args.model_list!r} names no model")
    if args.ops is None and args.dry_run:
        args._parser.error("--dry-run applies to --ops")
    if args.torchcompile or args.torchcompile_mode:  # (--runtime compile: inductor unless --torchcompile names one)
        check_torchcompile(args.torchcompile or "inductor", args.torchcompile_mode)
    return run(args)
