"""What a benchmark run writes: the results file (csv or json, timm's keys), markdown tables with the ratios
against the first peer, the fitted scaling exponents and the plot of time and peak memory against resolution."""

import csv
import io
import json
import math
import os
from typing import Dict, List, Optional, Tuple

from ttt_zoo.fileio import atomic_write

__all__ = ["PHASES", "write_results", "format_table", "format_ops_table", "scaling_exponents", "plot_results",
           "time_spread", "ratio_unsettled", "spread_warning"]

PHASES = {"infer": "inference", "train": "train (forward + backward)"}


def write_results(path: str, rows: List[Dict], machine: Optional[Dict] = None) -> None:
    """``.csv``: one row per measurement, the union of the keys as columns; ``.json``: machine and rows."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        from ttt_zoo.finite import json_dumps
        atomic_write(path, json_dumps(dict(machine=machine or {}, results=rows), "the bench results", indent=2)
                     + "\n")
    elif ext == ".csv":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(rows)
        atomic_write(path, buf.getvalue())
    else:
        raise ValueError(f"results file {path!r}: use a .csv or .json name")


def _references(rows: List[Dict]) -> List[str]:
    """Labels the ratios are taken against: every peer, else the first configuration when there are several."""
    peers = list(dict.fromkeys(r["label"] for r in rows if r.get("role") == "peer"))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    return peers if peers else (labels[:1] if len(labels) > 1 else [])


def _fmt(v, digits=None) -> str:
    """Fixed ``digits`` decimals, or (None) 3 significant digits without an exponent."""
    if v is None or v == "":
        return "-"
    if digits is None:
        digits = max(0, 2 - math.floor(math.log10(abs(v)))) if v else 0
    return f"{v:.{digits}f}"


def time_spread(row: Dict, phase: str) -> Optional[Tuple[float, float]]:
    """(min, max) ms of a cell's timed steps (all its repeats), or None for a row without them."""
    lo, hi = row.get(f"{phase}_step_time_min"), row.get(f"{phase}_step_time_max")
    return None if lo in (None, "") or hi in (None, "") else (float(lo), float(hi))


def ratio_unsettled(row: Dict, ref: Dict, phase: str) -> bool:
    """The rule for a time ratio that is not meaningful: the two cells' min-max step times overlap, so within the
    measured spread either could be the faster (the ratio's range, min/max' .. max/min', contains 1)."""
    a, b = time_spread(row, phase), time_spread(ref, phase)
    return row is not ref and a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def _unsettled(rows: List[Dict]) -> List[Tuple]:
    """(label, img size, phase, reference) of every time ratio :func:`ratio_unsettled` marks."""
    by = {(r["label"], r["img_size"]): r for r in rows}
    return [(r["label"], r["img_size"], p, ref) for p in PHASES for r in rows for ref in _references(rows)
            if f"{p}_step_time" in r and (ref, r["img_size"]) in by
            and ratio_unsettled(r, by[(ref, r["img_size"])], p)]


def spread_warning(rows: List[Dict]) -> Optional[str]:
    """One sentence when some time ratio is not meaningful (its cell is marked ``*``), else None."""
    bad = _unsettled(rows)
    if not bad:
        return None
    return (f"{len(bad)} time ratio(s) marked * are not meaningful: the min-max step times of the row and of the "
            "peer overlap, so the machine's load varied more than the two differ; measure again on a quiet machine "
            "(more --repeats / --num-bench-iter narrow the median, not the load)")


def format_table(rows: List[Dict]) -> str:
    """One markdown table per phase present; ratios = this row / each reference row (every peer) at the same size,
    from the medians; a time ratio whose two min-max ranges overlap is marked ``*`` (:func:`ratio_unsettled`)."""
    refs = _references(rows)
    by = {(r["label"], r["img_size"]): r for r in rows}
    out = []
    for p, title in PHASES.items():
        prow = [r for r in rows if f"{p}_step_time" in r or f"{p}_error" in r]
        if not prow:
            continue
        cpu = any(r.get(f"{p}_cpu_time") is not None for r in prow)
        spread = any(time_spread(r, p) for r in prow)
        head = ["img size", "model", "batch", "params (M)", "GMACs", "ms / step"] + ["ms min-max"] * spread
        head += ["samples / s", "peak MB"]
        saved = any(r.get(f"{p}_saved_mb") is not None for r in prow)
        head += ["CPU ms"] * cpu + ["saved MB"] * saved + (["GFLOP/s"] if p == "infer" else [])
        for ref in refs:
            head += [f"time / {ref}", f"memory / {ref}"]
        lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in prow:
            cells = [str(r["img_size"]), r["label"], str(r.get(f"{p}_batch_size", "-")), _fmt(r.get("param_count"), 2),
                     _fmt(r.get(f"{p}_gmacs"))]
            if f"{p}_error" in r:
                cells += [f"failed: {r[f'{p}_error']}"] + [""] * (len(head) - len(cells) - 1)
                lines.append("| " + " | ".join(cells) + " |")
                continue
            ms, mem = r[f"{p}_step_time"], r.get(f"{p}_peak_mem_mb")
            cells.append(_fmt(ms))
            if spread:
                lo_hi = time_spread(r, p)
                cells.append(f"{_fmt(lo_hi[0])}-{_fmt(lo_hi[1])}" if lo_hi else "-")
            cells += [_fmt(r[f"{p}_samples_per_sec"]), _fmt(mem)]
            if cpu:
                cells.append(_fmt(r.get(f"{p}_cpu_time")))
            if saved:
                cells.append(_fmt(r.get(f"{p}_saved_mb")))
            if p == "infer":
                g = r.get("infer_gmacs")
                cells.append(_fmt(2 * g * r["infer_batch_size"] / (ms / 1e3)) if g else "-")
            for ref in refs:
                b = by.get((ref, r["img_size"]), {})
                bms, bmem = b.get(f"{p}_step_time"), b.get(f"{p}_peak_mem_mb")
                cells.append(f"{ms / bms:.2f}x" + "*" * ratio_unsettled(r, b, p) if bms else "-")
                cells.append(f"{mem / bmem:.2f}x" if mem is not None and bmem else "-")
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    warning = spread_warning(rows)
    if warning:
        out.append(f"\\* {warning[0].upper()}{warning[1:]}.")
    exps = scaling_exponents(rows)
    if exps:
        out.append("Fitted scaling exponent k of time against pixel count (time ~ pixels^k; 1 = linear in tokens): "
                   + "; ".join(f"{lab} {PHASES[p].split()[0]} {k:.2f}" for (lab, p), k in exps.items()) + ".")
    return "\n\n".join(out)


def scaling_exponents(rows: List[Dict]) -> Dict:
    """Least-squares slope of log(step time) against log(H x W) per (label, phase) over 2+ sizes."""
    res = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        for p in PHASES:
            pts = [(math.log(r["img_h"] * r["img_w"]), math.log(r[f"{p}_step_time"])) for r in rows
                   if r["label"] == label and r.get(f"{p}_step_time")]
            if len({x for x, _ in pts}) < 2:
                continue
            mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
            res[(label, p)] = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return res


def format_ops_table(rows: List[Dict]) -> str:
    head = ["op", "shape", "dtype", "backend", "fwd ms", "fwd MB", "fwd+bwd ms", "fwd+bwd MB", "max abs out diff",
            "max rel grad diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["op"], r["shape"], r["dtype"], r["backend"]]
        if "error" in r:
            cells += [f"failed: {r['error']}"] + [""] * 5
        else:
            cells += [f"{r['fwd_ms']:.3f}", _fmt(r["fwd_peak_mb"]), f"{r['fwd_bwd_ms']:.3f}",
                      _fmt(r["fwd_bwd_peak_mb"]), *(f"{r[k]:.2e}" if k in r else "-"
                                                     for k in ("out_diff", "grad_rel_diff"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_results(rows: List[Dict], path: str, title: str = "") -> bool:
    """PNG: step time and peak memory against resolution (log-log), one line per model and phase.

    Returns False (and says why) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plot was written (pip install matplotlib); "
              "the table and the results file are complete without it.")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    sizes = sorted({(r["img_h"] * r["img_w"], str(r["img_size"])) for r in rows})
    styles = {"infer": "-o", "train": "--s"}
    for i, label in enumerate(dict.fromkeys(r["label"] for r in rows)):
        for p in PHASES:  # one colour per model, one line style per phase
            for ax, key in zip(axes, ("step_time", "peak_mem_mb")):
                pts = sorted((r["img_h"] * r["img_w"], r[f"{p}_{key}"]) for r in rows
                             if r["label"] == label and r.get(f"{p}_{key}"))
                if pts:
                    ax.plot(*zip(*pts), styles[p], color=f"C{i}", label=f"{label} ({PHASES[p].split()[0]})")
    for ax, ylabel in zip(axes, ("ms per step", "peak memory growth (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([s for s, _ in sizes], [lab for _, lab in sizes], rotation=45)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("image size (pixels, log scale)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    plt.close(fig)
    return True

