"""Compile the Triton kernels ahead of time for a CUDA target (no GPU needed) and report registers and spills per
kernel from ptxas -v: a check that the kernels build for a real GPU and how much register pressure each
configuration has.  One section per kernel family; each writes experiments/results/<family>_triton_compile.md.

    python experiments/compile_kernels.py                       # every family, sm_90
    python experiments/compile_kernels.py --families vit3 ttt_linear --block-d 64 128
"""
import argparse
import itertools
import os
import re
import subprocess
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # noqa: E402  (compile for the GPU, not the interpreter)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ttt_zoo.kernels.dwconv import triton as DW  # noqa: E402
from ttt_zoo.kernels.inner_mlp import triton as T  # noqa: E402
from ttt_zoo.kernels.key_norm import triton as KT  # noqa: E402
from ttt_zoo.kernels.linear_attention import triton as LA  # noqa: E402
from ttt_zoo.kernels.ttt_linear import triton as LT  # noqa: E402
from ttt_zoo.kernels.vit3_ttt import fused as VF  # noqa: E402
from ttt_zoo.kernels.vit3_ttt import ops as VO  # noqa: E402
from ttt_zoo.kernels.vit3_ttt import triton as VT  # noqa: E402
from ttt_zoo.kernels.vit3_variant import fused as VV  # noqa: E402

_INT = ("N", "C", "H", "D", "B", "CK", "Hh", "Ww", "HEADS", "DC", "MB", "RQ", "RK")
_IO = ("K", "V", "Q", "O", "DO", "DQ", "DK", "DV", "X", "Y", "DY", "DX")  # activations: bf16 here
_FLOAT = ("c", "eps", "alpha", "lr", "lr_scale")


def _signature(fn, consts, io=_IO):
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in _FLOAT:
            sig[a] = "fp32"
        elif a in _INT or a[0].islower():
            sig[a] = "i32"
        else:
            sig[a] = "*bf16" if a in io else "*fp32"
    return sig


def _compile(fn, consts, arch, num_warps, io=_IO, stages=None):
    t0 = time.time()
    options = dict(num_warps=num_warps) if stages is None else dict(num_warps=num_warps, num_stages=stages)
    k = triton.compile(ASTSource(fn, _signature(fn, consts, io), consts), target=GPUTarget("cuda", arch, 32),
                       options=options)
    secs = time.time() - t0
    regs, spill = ptxas_stats(k.asm["ptx"], arch)
    return secs, regs, spill, k.metadata.shared


def ptxas_stats(ptx: str, arch: int):
    """(registers, spill-store bytes) of a PTX module from ``ptxas -v`` for ``sm_<arch>`` ('?' where not reported)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}", f.name,
                        "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return regs.group(1) if regs else "?", spill.group(1) if spill else "?"


def _header(title, arch, note):
    return [f"# {title} Triton kernels compiled for sm_{arch} (no GPU; ptxas -v)", "",
            f"triton {triton.__version__}; {note}  Compile seconds on a shared 2-core CPU (noisy).", "",
            "| kernel | variant | dtype | BLOCK_D | tile | warps | compile s | registers/thread | spill stores (bytes) "
            "| shared memory (bytes) |",
            "|---|---|---|---|---|---|---|---|---|---|"]


def _row(fn, variant, bd, tile, warps, consts, arch, io=_IO, stages=None):
    act = next((v[1:] for a, v in _signature(fn, consts, io).items() if a in io), "-")  # the activations' dtype
    head = f"| {fn.__name__} | {variant} | {act} | {bd} | {tile} | {warps} |"
    try:
        secs, regs, spill, shared = _compile(fn, consts, arch, warps, io, stages)
        row = f"{head} {secs:.0f} | {regs} | {spill} | {shared} |"
    except Exception as e:  # report, do not hide
        row = f"{head} - | FAILED {type(e).__name__}: {' '.join(str(e).split())[:80]} | | |"
    print(row, flush=True)
    return row


def vit3_rows(block_ds, arch):
    """ViT3 SwiGLU kernels (column blocks above MAX_COLS) and the 3x3 conv-branch kernels, shipped tile sizes, per
    activation dtype (loads upcast to fp32: the dots in IEEE fp32 for fp32, TF32 for fp16 / bf16, as triton.prec)."""
    lines = []
    for act, (dt, _) in _ACT.items():
        prec = "ieee" if act == "fp32" else "tf32"
        for bd in block_ds:
            bc = VT._block_c(bd)
            tiles = dict(TILES=VT.TILES)  # the reduction kernels
            for fn, pass_, extra in ((VT._swiglu_vjp, "update", dict(WRITE_DX=False, **tiles)),
                                     (VT._swiglu_apply, "apply", {}),
                                     (VT._swiglu_vjp, "apply bwd", dict(WRITE_DX=True, **tiles)),
                                     (VT._swiglu_update_bwd, "update bwd", tiles)):
                bn, warps = VT._reduce_cfg(bd, {"fp32": torch.float32, "fp16": torch.float16,
                                                "bf16": torch.bfloat16}[act])
                consts = dict(BLOCK_N=bn, BLOCK_D=bd, BLOCK_C=bc, PREC=prec, **extra)
                lines.append(_row_act(dt, fn, f"{pass_}, {bd // bc} column block(s) of {bc}, {act}", bd, bn, warps,
                                      consts, arch))
        for fn in (VT._taps, VT._dwconv):
            consts = {a: getattr(VT, a) for a in ("BLOCK_P",) if a in fn.arg_names}
            consts.update({a: VT.TILES for a in ("TILES",) if a in fn.arg_names})
            lines.append(_row_act(dt, fn, f"3x3 conv branch, {act}", "-", VT.BLOCK_P, 4, consts, arch,
                                  io=("X", "E", "O")))
    return lines + vit3_fused_rows(block_ds, arch) + vit3_variant_rows(block_ds, arch)


_FUSED_IO = tuple(f"{p}{i}" for p in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV") for i in (1, 2))


def vit3_fused_rows(block_ds, arch):
    """The mixer core's fused kernels (fused.py: both branches per launch), the launcher's tiles and warps, per
    activation dtype (dots on the loaded dtype; fp32 in IEEE, as triton_utils.dot_prec without TF32)."""
    lines = []
    kernels = (VF._fwd_update, VF._fwd_finalize, VF._fwd_apply, VF._bwd_apply, VF._bwd_finalize, VF._bwd_update,
               VF._bwd_reduce)
    for act, (dt, prec) in _ACT.items():
        for bd in [bd for bd in block_ds if bd <= VO.FUSED_MAX_HEAD_DIM]:  # above: the per-branch kernels
            torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[act]
            for fn in kernels:
                bn, warps = VF.launch_cfg(bd, torch_dtype, fn.__name__)
                consts = {a: v for a, v in dict(TILES=VF.TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=VF.BLOCK_P,
                                                BLOCK_CH=VF.conv_block(bd), PREC=prec, NORM=True,
                                                DETERMINISTIC=False, ROPE=False).items() if a in fn.arg_names}
                tile = f"{bn} tokens / {VF.BLOCK_P} px x {VF.conv_block(bd)} ch"
                lines.append(_row_act(dt, fn, f"fused (SwiGLU + conv), {act}", bd, tile, warps, consts, arch,
                                      io=_FUSED_IO))
    return lines


_VARIANT_IO = ("K1", "V1", "Q1", "O1", "DO1", "DQ1", "DK1", "DV1", "K2", "V2", "Q2", "O2", "DO2", "DQ2", "DK2", "DV2")


def vit3_variant_rows(block_ds, arch):
    """The ViT3 variants' fused core (vit3_variant/fused.py) per inner model (KIND: the full SwiGLU, the last layer,
    one linear layer), fp32 / fp16 / bf16 activations, the launcher's tiles and warps (vit3_ttt.fused.launch_cfg)."""
    lines = []
    kernels = (VV._fwd_update, VV._fwd_finalize, VV._fwd_apply, VV._bwd_apply, VV._bwd_finalize, VV._bwd_update)
    for bd in [bd for bd in block_ds if bd <= VO.FUSED_MAX_HEAD_DIM]:  # above: the per-branch kernels
        bn, warps = VV.launch_cfg(bd)
        for act, (name, kind), fn in itertools.product(_ACT, VV.KINDS.items(), kernels):
            consts = {a: v for a, v in dict(KIND=kind, TILES=VV.TILES, BLOCK_N=bn, BLOCK_D=bd, BLOCK_P=VV.BLOCK_P,
                                            PREC=VV.dot_prec(_TORCH[act]), NORM=True, SHARE=False,
                                            ROPE=False).items()
                      if a in fn.arg_names}  # the launcher's dot precision per dtype
            lines.append(_row_act(act, fn, f"variant core, {name}", bd, f"{bn} tokens / {VV.BLOCK_P} px", warps,
                                  consts, arch, io=_VARIANT_IO))
    return lines


def linear_attention_rows(block_ds, arch, mini_batch=16):
    """The linear-attention Vision-TTT forward scan (one program per (batch x direction, head)), per dtype."""
    lines = []
    for act, (dt, _) in _ACT.items():
        for bd in block_ds:
            warps = 4 if bd <= 32 else 8
            consts = dict(BLOCK_C=max(16, triton.next_power_of_2(mini_batch)), BLOCK_D=bd,
                          PREC="ieee" if act == "fp32" else "tf32")
            lines.append(_row_act(dt, LA._la_fwd, f"forward scan, {act}", bd, f"mini-batch {mini_batch}", warps,
                                  consts, arch))
    return lines


def ttt_linear_rows(block_ds, arch, mini_batch=16):
    """TTT-Linear scan kernels (the recurrences per sequence, the output passes per chunk), both LN-residual
    settings."""
    lines = []
    for bd in block_ds:
        bc, _, warps = LT._launch_cfg(bd, mini_batch)
        # the MSE loss with and without the LN residual, and the dot loss (the LA forms: no _bwd_keys pass)
        for loss, ln, dot in (("mse", True, False), ("mse", False, False), ("dot", False, True)):
            fns = (LT._fwd_states, LT._fwd_outputs, LT._bwd_outputs, LT._bwd_states) + (() if dot else (LT._bwd_keys,))
            for act, fn in itertools.product(_ACT, fns):
                # the shipped configuration: RoPE, the lr sigmoid and the tau offsets inside the kernels
                consts = dict(MB=mini_batch, BLOCK_C=bc, BLOCK_D=bd, LN_RES=ln, PREC=LT._prec(_TORCH[act]),
                              ROPE=True, LR_SIG=True, TAU_OFF=True, DOT=dot, SHARED=False)
                variant = f"ln_residual={ln}" if loss == "mse" else "dot loss"
                lines.append(_row_act(act, fn, variant, bd, f"mini-batch {mini_batch}", warps, consts, arch))
    lines.append(_row(LT._reduce_partials, "partial sums (fp32)", "-", "1024", 4, dict(MB=mini_batch, BLOCK=1024),
                      arch, io=()))
    return lines


_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_ACT = {"fp32": ("fp32", "ieee"), "fp16": ("fp16", "ieee"), "bf16": ("bf16", "ieee")}  # activations, fp32 dots


def _row_act(act, *args, **kwargs):
    """_row with the activations (``_IO``) in ``act`` instead of bf16 (inner_mlp section)."""
    global _signature
    base = _signature
    _signature = lambda *a: {k: (f"*{act}" if v == "*bf16" else v) for k, v in base(*a).items()}  # noqa: E731
    try:
        return _row(*args, **kwargs)
    finally:
        _signature = base


def inner_mlp_rows(block_ds, arch):
    """T5 (gated) / DiT5 inner-step kernels (3 + 3 launches; 2 + 2 one-chunk variants) per activation dtype, and the
    key instance-norm."""
    lines = []
    kernels = ((T._fwd_update, "update"), (T._fwd_finalize, "finalize"), (T._fwd_apply, "apply"),
               (T._bwd_apply, "bwd"), (T._bwd_finalize, "finalize"), (T._bwd_update, "bwd"),
               (T._bwd_reduce, "finalize"))  # the last only under torch.use_deterministic_algorithms
    for bd in block_ds:
        for act, (dt, prec) in _ACT.items():
            for fn, pass_ in kernels:
                bn, tiles, warps = T.launch_cfg(bd, pass_, dt == "fp32") if pass_ != "finalize" else \
                    (min(T.BLOCK_C, bd), 1, 4)
                # the backward kernels' stages and SPLIT (fp32 at d = 64: halved dots) as the launcher picks them
                stages, split = T.bwd_tuning(fn.__name__, bd, dt == "fp32") if "SPLIT" in fn.arg_names else (None, 1)
                for gated, mix in itertools.product((True, False), (False, True) if "HAS_MIX" in fn.arg_names
                                                    else (False,)):
                    if mix and not gated:
                        continue  # the TTT / attention blend is T5+'s (gated)
                    consts = {a: v for a, v in dict(GATED=gated, TILES=tiles, BLOCK_N=bn, BLOCK_D=bd, PREC=prec,
                                                    BLOCK_C=min(T.BLOCK_C, bd), DETERMINISTIC=False,
                                                    HAS_MIX=mix, SPLIT=split).items()
                              if a in fn.arg_names}
                    tile = f"{bn} columns" if pass_ == "finalize" else f"{bn} tokens"
                    variant = ("T5+" if mix else "T5" if gated else "DiT5") + (f", {stages} stages, SPLIT {split}"
                                                                               if stages is not None else "")
                    lines.append(_row_act(dt, fn, variant, bd, tile, warps, consts, arch, stages=stages))
    for fn, extra in ((KT._knorm_fwd, dict(CAT=False, COPY=False)), (KT._knorm_fwd, dict(CAT=True, COPY=False)),
                      (KT._knorm_fwd, dict(CAT=True, COPY=True)), (KT._knorm_bwd, dict(ADD=False)),
                      (KT._knorm_bwd, dict(ADD=True))):
        variant = "key-norm" + "".join(f", {k}" for k, v in extra.items() if v)
        lines.append(_row(fn, variant, f"{KT.BLOCK_C} (C)", KT.BLOCK_N, 4,
                          {a: v for a, v in dict(BLOCK_N=KT.BLOCK_N, BLOCK_C=KT.BLOCK_C, BLOCK_T=16, **extra).items()
                           if a in fn.arg_names}, arch))
    return lines


def dwconv_rows(block_ds, arch):
    """The residual depthwise 3x3 conv (the blocks' CPE, H-ViT3's MLP conv + GELU): forward, backward (dx and the
    dW / db partials; for the MLP's recomputing backward also its output and the first GELU's gradient) and the
    reduction, per activation dtype and act, the shipped tile (a 64-channel block: C >= 64) and warps."""
    lines = []
    tile = f"{DW.BLOCK_T} tokens x {DW.MAX_BLOCK_C} ch"
    for act, (dt, _) in _ACT.items():
        for act_name, code in DW.ACT_CODES.items():
            bwd = [dict(WRITE_Y=False, IN_GELU=False)] + ([dict(WRITE_Y=True, IN_GELU=True)] if code else [])
            for fn, extra in [(DW._fwd, {})] + [(DW._bwd, dict(ROWS=DW.ROWS, **e)) for e in bwd]:
                consts = dict(ACT=code, HAS_BIAS=True, BLOCK_T=DW.BLOCK_T, BLOCK_C=DW.MAX_BLOCK_C, **extra)
                variant = f"act={act_name}{', writes y, dh (MLP)' if extra.get('WRITE_Y') else ''}, {act}"
                lines.append(_row_act(dt, fn, variant, "-", tile, DW.NUM_WARPS, consts, arch,
                                      io=("X", "Y", "DY", "DX", "HPRE")))
    lines.append(_row(DW._reduce, "dW / db partials (fp32)", "-", f"{DW.BLOCK_P} rows x {DW.MAX_BLOCK_C} ch", 4,
                      dict(BLOCK_P=DW.BLOCK_P, BLOCK_C=DW.MAX_BLOCK_C, ROWS=DW.ROWS), arch, io=()))
    return lines


FAMILIES = {
    "vit3": ("ViT3 / H-ViT3 / DiT3", vit3_rows, "fp32 / fp16 / bf16 activations, fp32 weights/partials; shipped tiles and warps.  The "
             "fused kernels (fused.py) run head dims up to ops.FUSED_MAX_HEAD_DIM = 64 (at BLOCK_D 128 they spilled up to "
             "10,304 bytes and _bwd_update needed 311,296 bytes of shared memory); above, the per-branch kernels."),
    "linear_attention": ("Vision-TTT linear attention", linear_attention_rows,
                         "fp32 / fp16 / bf16 q/k/v (loads upcast to fp32), fp32 state; the launcher's warps."),
    "ttt_linear": ("Vision-TTT TTT-Linear", ttt_linear_rows, "fp32 / fp16 / bf16 q/k/v, fp32 state; shipped launch config."),
    "dwconv": ("Residual depthwise 3x3 conv (CPE, H-ViT3 MLP)", dwconv_rows,
               "fp32 / fp16 / bf16 activations (loads upcast to fp32), fp32 weights and partials; launcher's tiles."),
    "t5": ("T5 / DiT5 / key-norm", inner_mlp_rows,
           "fp32 / fp16 / bf16 activations (dots on their dtype, fp32 accumulation), fp32 weights/partials; "
           "tiles and warps as inner_mlp.triton.launch_cfg picks them."),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--block-d", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    for fam in args.families:
        title, rows, note = FAMILIES[fam]
        lines = _header(title, args.arch, note) + rows(args.block_d, args.arch)
        with open(os.path.join(args.out_dir, f"{fam}_triton_compile.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out_dir, f"sm{args.arch}_kernels.md"), "w") as f:  # the one table, every family
        f.write("\n".join(summary(args.out_dir, args.arch)) + "\n")


def summary(out_dir, arch):
    """One row per compiled kernel of every family's report in ``out_dir`` (the families can run apart):
    registers, spills, shared memory."""
    rows = []
    for fam in FAMILIES:
        path = os.path.join(out_dir, f"{fam}_triton_compile.md")
        if os.path.exists(path):
            for line in open(path).read().splitlines():
                cells = [c.strip() for c in line.split("|")[1:-1]]
                if len(cells) == 10 and cells[0].startswith("_"):  # kernel, variant, dtype, BLOCK_D, ..., shared
                    rows.append([fam, cells[0], cells[1], cells[2], cells[3], cells[7], cells[8], cells[9]])
    spilling = [r for r in rows if r[6] not in ("0", "")]
    failed = [r for r in rows if r[5].startswith("FAILED")]
    lines = [f"# Every Triton kernel compiled for sm_{arch}: registers, spills, shared memory", "",
             f"`python experiments/compile_kernels.py` (no GPU: triton {triton.__version__}, ptxas -v; tiles, warps "
             "and compile times in the `<family>_triton_compile.md` files beside this one; a family's report older "
             "than its kernels is stale: rerun it).  "
             f"{len(rows)} compiles, {len(spilling)} with spill stores "
             f"({', '.join(sorted({f'{r[0]}/{r[1]}' for r in spilling})) or 'none'}), {len(failed)} failed.  "
             "Shared memory limit on sm_90: 232,448 bytes per block.", "",
             "| family | kernel | variant | dtype | BLOCK_D | registers | spill bytes | shared memory (bytes) |",
             "|---|---|---|---|---|---|---|---|"]
    return lines + [f"| {' | '.join(r)} |" for r in rows]


if __name__ == "__main__":
    main()
