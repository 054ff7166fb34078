"""``ttt-zoo kernels``: every TTT op, its paths, what ``auto`` runs on this machine and why, and the versions.

``--verify`` runs the kernel checks now (``ttt_zoo.kernels.verify.check_op``): on a GPU at its shapes, timing both
paths; on the CPU in the Triton interpreter at small shapes (in a child process with ``TRITON_INTERPRET=1`` unless
this one has it: Triton reads it when first imported).  ``--json`` prints the same as JSON (for bug reports).
"""
import json
import os
import sys
from typing import Dict, List

__all__ = ["add_parser", "auto_pick", "kernel_report"]



def _device(name: str):
    import torch
    from ._common import UsageError
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name}: not a device name; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here; use --device cpu (the Triton interpreter)")
    if device.type not in ("cuda", "cpu"):
        raise UsageError(f"--device {name}: the kernels run on cuda or cpu (interpreter); use one of those")
    return device


def auto_pick(op: str, device, dtype) -> Dict[str, str]:
    """What ``auto`` runs for ``op`` on ``device`` and why; runs no check."""
    import torch
    from ttt_zoo.kernels import verify as V
    from ttt_zoo.kernels.backend import ENV_VAR, default_backend, triton_unsupported
    forced = default_backend()
    if forced != "auto":
        return dict(pick=forced, why=f"forced ({ENV_VAR} or set_backend)")
    # off CUDA, the limits that hold anywhere (the meta device: no complaint about the CPU itself)
    reason = triton_unsupported(device if device.type == "cuda" else torch.device("meta"), dtype, None, op)
    if reason is not None:
        return dict(pick="torch", why=f"limit: {reason}")
    if device.type != "cuda":
        return dict(pick="torch", why="not CUDA: auto runs the kernels on CUDA only")
    if V.gpu_verified(op):
        return dict(pick="triton", why="repository record (gpu_verified.json) matches the kernel sources")
    entry = V.cache_entry(op, device, dtype) if V.device_name(device) is not None else None
    if entry is None:
        return dict(pick="torch until checked", why="not checked here yet: checked on first use (or --verify)")
    return dict(pick=entry["choice"], why=entry["why"])


def kernel_report(device_name: str = "auto", verify: bool = False, dtypes=("float32",)) -> Dict:
    """The table as a dict: the machine, and one row per (op, dtype); ``verify`` runs the checks first."""
    import platform
    import torch
    from ttt_zoo.kernels import available_ops
    from ttt_zoo.kernels import verify as V
    from ttt_zoo.kernels.backend import triton_unsupported
    device = _device(device_name)
    rows: List[Dict] = []
    for op, paths in available_ops().items():
        for dt in dtypes:
            dtype = getattr(torch, dt)
            row = dict(op=op, dtype=dt, paths=[p for p, has in paths.items() if has])
            entry = None
            if verify and paths["triton"] and triton_unsupported(device, dtype, None, op) is None:
                entry = V.check_op(op, device, dtype)
            elif paths["triton"] and V.device_name(device) is not None:
                entry = V.cache_entry(op, device, dtype)  # an earlier check on this machine, or None
            if entry is not None:
                row["check"] = {k: entry[k] for k in ("passed", "error", "tol", "case", "ms", "choice", "why")}
            row.update(auto_pick(op, device, dtype))
            if not row.get("check", {"passed": True})["passed"]:
                row["why"] += f"; {row['check']['why']}"
            rows.append(row)
    cuda = torch.version.cuda if torch.cuda.is_available() or device.type == "cuda" else None
    return dict(device=V.device_name(device), device_type=device.type, torch=str(torch.__version__),
                triton=V.triton_version(), cuda=cuda, python=platform.python_version(),
                triton_interpret=os.environ.get("TRITON_INTERPRET") == "1", cache=str(V.cache_path()),
                records=str(V.records_path()), ops=rows)


def _print_table(report: Dict) -> None:
    print(f"device: {report['device']}  torch {report['torch']}  Triton {report['triton'] or 'not installed'}  "
          f"CUDA {report['cuda'] or '-'}  Python {report['python']}")
    print(f"records: {report['records']}\ncache:   {report['cache']}")
    head = ("op", "dtype", "paths", "check", "auto picks here", "why")
    rows = [(r["op"], r["dtype"], ",".join(r["paths"]), _check_cell(r.get("check")), r["pick"], r["why"])
            for r in report["ops"]]
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head) - 1)]
    for r in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


def _check_cell(check) -> str:
    if check is None:
        return "-"
    if not check["passed"]:
        return "FAILED"
    ms = check["ms"]
    return f"ok {check['error']:.1e}" + (f" {ms['triton']:.3g}/{ms['torch']:.3g} ms" if ms else "")


def _in_interpreter(args) -> int:
    """Run this command again in a child process with TRITON_INTERPRET=1 (Triton reads it when it is first
    imported, which ``import ttt_zoo`` has done); its exit status."""
    import subprocess
    argv = ["kernels", "--verify", "--device", args.device, "--dtype", *args.dtype] + (["--json"] if args.json else [])
    return subprocess.call([sys.executable, "-m", "ttt_zoo", *argv], env=dict(os.environ, TRITON_INTERPRET="1"))


def run(args) -> int:
    if args.verify and not args.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        import torch
        if args.device == "cpu" or not torch.cuda.is_available():
            return _in_interpreter(args)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kernel_report(args.device, verify=args.verify, dtypes=args.dtype)
    report["warnings"] = [str(w.message) for w in caught]
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_table(report)
        for w in report["warnings"]:
            print(f"warning: {w}")
    if args.verify and any(r.get("check") and not r["check"]["passed"] for r in report["ops"]):
        return 1
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kernels", help="the TTT ops, their paths and what `auto` runs on this machine (and why)",
                       description="Every TTT op, its paths, what backend 'auto' picks on this machine and why "
                                   "(repository record, local check, limit), with the device, torch, Triton and "
                                   "CUDA versions.")
    p.add_argument("--verify", action="store_true",
                   help="run the kernel checks now (Triton vs PyTorch, forward and backward; on a GPU also timed); "
                        "on the CPU they run in the Triton interpreter at small shapes; exit 1 if one fails")
    p.add_argument("--json", action="store_true", help="print the report as JSON (attach it to a bug report)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda where available)")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "float16", "bfloat16"],
                   help="the dtypes to report and check")
    p.set_defaults(func=run)
