"""Compile the T5 / DiT5 inner-step and key-norm Triton kernels ahead of time for a CUDA target (no GPU needed)
and report registers and spills per kernel from ptxas -v: a check that the kernels build for a real GPU and how
much register pressure each configuration has.  Writes tools/results/t5_triton_compile.md.

    python tools/compile_t5_kernels.py [--arch 90] [--block-d 32 64 128] [--out ...]
"""
import argparse
import os
import re
import subprocess
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # noqa: E402  (compile for the GPU, not the interpreter)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ttt_zoo.kernels.inner_mlp import triton as T  # noqa: E402
from ttt_zoo.kernels.key_norm import triton as KT  # noqa: E402

_INT = ("N", "C", "H", "D")
_IO = ("K", "V", "Q", "O", "DO", "DQ", "DK", "DV", "X", "Y", "DY", "DX")  # activations: bf16 here


def _signature(fn, consts):
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in _INT or a[0].islower() and a not in ("c", "eps"):
            sig[a] = "i32"
        elif a in ("c", "eps"):
            sig[a] = "fp32"
        else:
            sig[a] = "*bf16" if a in _IO else "*fp32"
    return sig


def _compile(fn, consts, arch, num_warps):
    t0 = time.time()
    k = triton.compile(ASTSource(fn, _signature(fn, consts), consts), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps))
    secs = time.time() - t0
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}", f.name,
                        "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return secs, regs.group(1) if regs else "?", spill.group(1) if spill else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--block-d", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "t5_triton_compile.md"))
    args = ap.parse_args()
    lines = [f"# T5 / DiT5 / key-norm Triton kernels compiled for sm_{args.arch} (no GPU; ptxas -v)", "",
             f"triton {triton.__version__}; bf16 activations, fp32 weights/partials; BLOCK_N and num_warps as the "
             "launchers choose them.  Compile seconds on a shared 2-core CPU (noisy).", "",
             "| kernel | model | BLOCK_D | BLOCK_N | warps | compile s | registers/thread | spill stores (bytes) |",
             "|---|---|---|---|---|---|---|---|"]
    for bd in args.block_d:
        warps = T._warps(bd)
        for fn, pass_ in ((T._update, "update"), (T._apply, "apply"), (T._apply_bwd, "bwd"), (T._update_bwd, "bwd")):
            bn = T._block_n(bd, pass_)
            for gated in (True, False):
                consts = dict(GATED=gated, BLOCK_N=bn, BLOCK_D=bd, PREC="tf32")
                if "TILES" in fn.arg_names:
                    consts["TILES"] = T._tiles(bn)
                try:
                    secs, regs, spill = _compile(fn, consts, args.arch, warps)
                    row = f"| {fn.__name__} | {'T5' if gated else 'DiT5'} | {bd} | {bn} | {warps} | {secs:.0f} | " \
                          f"{regs} | {spill} |"
                except Exception as e:  # report, do not hide
                    row = f"| {fn.__name__} | {'T5' if gated else 'DiT5'} | {bd} | {bn} | {warps} | - | " \
                          f"FAILED {type(e).__name__}: {str(e)[:80]} | |"
                print(row, flush=True)
                lines.append(row)
    for fn in (KT._knorm_fwd, KT._knorm_bwd):
        secs, regs, spill = _compile(fn, dict(BLOCK_N=KT.BLOCK_N, BLOCK_C=KT.BLOCK_C), args.arch, 4)
        lines.append(f"| {fn.__name__} | key-norm | {KT.BLOCK_C} (C) | {KT.BLOCK_N} | 4 | {secs:.0f} | {regs} | {spill} |")
        print(lines[-1], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
