"""Whole-model torch.compile (inductor, CPU) against eager for the smallest model of every family.

For each family: graph breaks (``torch._dynamo.explain``, with their reasons), then one ``dynamic=True`` compile
run at two sizes (the default and a non-square one), forward and backward: the largest relative difference of
the output and of every parameter gradient (max |compiled - eager| / max |eager|), and how many graphs dynamo
compiled across the sizes.  Writes a markdown table atomically.

    PYTHONPATH=$PWD python tools/compile_report.py --out tools/results/compile_graph_breaks.md
    PYTHONPATH=$PWD python tools/compile_report.py --families vit3 dit --full   # full depth (slow)
"""

import argparse
import sys
from typing import Dict, List

import torch

import ttt_zoo
from ttt_zoo.bench.compile import SMALL, compiled_parity, graph_breaks, small_model


def check_family(family: str, full: bool = False) -> Dict:
    name, model, sizes = small_model(family, full)
    row = dict(family=family, model=name, kwargs="" if full else str(SMALL[family]))
    row.update(graph_breaks(name, model, sizes[0]))
    row.update({f"c_{k}": v for k, v in compiled_parity(name, model, sizes).items()})
    return row


def table(rows: List[Dict]) -> str:
    lines = ["| family | model (kwargs) | graphs / breaks (explain) | compiled graphs over both sizes | sizes | "
             "max rel. err. output (vs eager fp32 / fp64) | max rel. err. grads (vs eager fp32 / fp64) | "
             "compile+run s | break reasons |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['model']} | error: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['family']} | {r['model']} {r['kwargs']} | {r['graphs']} / {r['breaks']} | "
                     f"{r['c_graphs']} | {', '.join(r['c_sizes'])} | {r['c_fwd']:.1e} / {r['c_fwd_f64']:.1e} | "
                     f"{r['c_grad']:.1e} / {r['c_grad_f64']:.1e} | "
                     f"{r['c_seconds']:.0f} | {'; '.join(r['reasons']) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="*", default=None, help="default: every family")
    p.add_argument("--full", action="store_true", help="the full-depth models (default: one block per stage)")
    p.add_argument("--out", help="markdown file (written atomically)")
    args = p.parse_args(argv)
    families = args.families or list(ttt_zoo.list_zoo_families(include_diffusion=True))
    rows = []
    for f in families:
        try:
            rows.append(check_family(f, args.full))
        except Exception as e:  # noqa: BLE001 - one family's failure is a row of the report, not the end of it
            rows.append(dict(family=f, model=ttt_zoo.list_zoo_families(True).get(f, "?"),
                             error=f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    if args.out:
        from ttt_zoo.bench.measure import atomic_write
        atomic_write(args.out, "# Whole-model torch.compile (inductor, CPU, fp32, dynamic=True) against eager\n\n"
                     f"`python tools/compile_report.py {' '.join(argv if argv is not None else sys.argv[1:])}`, "
                     f"torch {torch.__version__}, {torch.get_num_threads()} threads.  Batch 2, eval mode; "
                     "errors are max |compiled - eager| / max |eager| of the output and of every parameter "
                     "gradient (loss: output times a fixed random tensor).\n\n" + text + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
