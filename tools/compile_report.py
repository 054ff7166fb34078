"""Whole-model torch.compile (inductor, CPU) against eager for the smallest model of every family.

For each family: graph breaks (``torch._dynamo.explain``, with their reasons), then one ``dynamic=True`` compile
run at two sizes (the default and a non-square one), forward and backward: the largest relative difference of
the output and of every parameter gradient (max |compiled - eager| / max |eager|), and how many graphs dynamo
compiled across the sizes.  Writes a markdown table atomically.

    PYTHONPATH=$PWD python tools/compile_report.py --out tools/results/compile_graph_breaks.md
    PYTHONPATH=$PWD python tools/compile_report.py --families vit3 dit --full   # full depth (slow)
"""

import argparse
import os
import sys
import time
from typing import Dict, List, Sequence, Tuple

import torch

import ttt_zoo

# one block per stage: the same block code as the full models, compiled in a fraction of the time
SMALL = {"vit3": dict(depth=1), "t5": dict(depth=1), "t5_plus": dict(depth=1), "visionttt": dict(depth=1),
         "hvit3": dict(depths=(1, 1, 1, 1)), "visionttt_h": dict(depths=(1, 1, 1, 1)), "dit": dict(depth=1),
         "dit3": dict(depth=1), "dit5": dict(depth=1)}
IMAGE_SIZES = ((224, 224), (160, 256))  # classifiers (multiples of 32)
LATENT_SIZES = ((32, 32), (24, 40))  # DiT latents (the s_2 models' default is 32)


def inputs(name: str, model: torch.nn.Module, hw: Tuple[int, int], batch: int = 2, seed: int = 0) -> Tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, getattr(model, "in_chans", 3), *hw, generator=g)
    if ttt_zoo.is_diffusion_model(name):
        return x, torch.rand(batch, generator=g) * 999, torch.randint(0, 1000, (batch,), generator=g)
    return (x,)


def _step(fn, model: torch.nn.Module, args: Tuple) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = fn(*args)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))  # a loss touching every output
    (out * w).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def parity(name: str, model: torch.nn.Module, sizes: Sequence[Tuple[int, int]]) -> Dict:
    """Compiled (inductor, dynamic=True) vs eager at each size: max relative error of output and gradients."""
    torch._dynamo.reset()
    model.eval()  # no dropout / label dropout: eager and compiled see the same function
    compiled = torch.compile(model, backend="inductor", dynamic=True)
    res = dict(fwd=0.0, grad=0.0, sizes=[])
    t0 = time.perf_counter()
    for hw in sizes:
        args = inputs(name, model, hw)
        ref, gref = _step(model, model, args)
        out, gout = _step(compiled, model, args)
        assert set(gout) == set(gref), "compiled backward reached other parameters"
        res["fwd"] = max(res["fwd"], _rel(out, ref))
        res["grad"] = max([res["grad"]] + [_rel(gout[k], gref[k]) for k in gref])
        res["sizes"].append("x".join(map(str, hw)))
    res["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    res["seconds"] = time.perf_counter() - t0
    return res


def graph_breaks(name: str, model: torch.nn.Module, hw: Tuple[int, int]) -> Dict:
    torch._dynamo.reset()
    e = torch._dynamo.explain(model.eval())(*inputs(name, model, hw))
    reasons = []
    for b in e.break_reasons:
        where = b.user_stack[-1] if b.user_stack else None
        reasons.append(f"{b.reason.splitlines()[0][:80]} at {os.path.basename(where.filename)}:{where.lineno}"
                       if where else b.reason.splitlines()[0][:80])
    return dict(graphs=e.graph_count, breaks=e.graph_break_count, reasons=sorted(set(reasons)))


def check_family(family: str, full: bool = False) -> Dict:
    name = ttt_zoo.list_zoo_families(include_diffusion=True)[family]
    torch.manual_seed(0)
    model = ttt_zoo.create_model(name, **({} if full else SMALL[family]))
    sizes = LATENT_SIZES if ttt_zoo.is_diffusion_model(name) else IMAGE_SIZES
    row = dict(family=family, model=name, kwargs="" if full else str(SMALL[family]))
    row.update(graph_breaks(name, model, sizes[0]))
    row.update({f"c_{k}": v for k, v in parity(name, model, sizes).items()})
    return row


def table(rows: List[Dict]) -> str:
    lines = ["| family | model (kwargs) | graphs / breaks (explain) | compiled graphs over both sizes | sizes | "
             "max rel. err. output | max rel. err. grads | compile+run s | break reasons |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['model']} | error: {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['family']} | {r['model']} {r['kwargs']} | {r['graphs']} / {r['breaks']} | "
                     f"{r['c_graphs']} | {', '.join(r['c_sizes'])} | {r['c_fwd']:.1e} | {r['c_grad']:.1e} | "
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
