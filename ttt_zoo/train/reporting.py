"""What a person sees of a run: log lines (tqdm on a terminal), ``summary.csv`` and ``train_plot.png``.

summary.csv uses timm's column names (``epoch``, ``train_<k>``, ``eval_<k>``, ``lr``) plus ``train_img_per_sec``
and ``epoch_time``; the trainer commits its whole text with the epoch's checkpoint (one atomic set, see
:mod:`ttt_zoo.train.run_state`), so it is never torn and never loses a committed epoch's row.
"""
from __future__ import annotations

import csv
import io
import logging
import os
import sys
from typing import Any, Dict, List, Optional

from ttt_zoo.fileio import atomic_path, atomic_write

__all__ = ["setup_logging", "Summary", "write_plot"]

_logger = logging.getLogger("ttt_zoo.train")


def setup_logging(log_file: Optional[str], is_primary: bool) -> logging.Logger:
    """Plain ``time message`` lines on stderr (primary rank only) and, when given, appended to ``log_file``."""
    _logger.setLevel(logging.INFO if is_primary else logging.WARNING)
    _logger.propagate = False
    for h in list(_logger.handlers):
        _logger.removeHandler(h)
        h.close()
    fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(fmt)
    _logger.addHandler(h)
    if log_file and is_primary:
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        _logger.addHandler(fh)
    return _logger


class Summary:
    """Rows of summary.csv, one per epoch; kept in memory and rewritten atomically."""

    def __init__(self, path: str):
        self.path = path
        self.rows: List[Dict[str, Any]] = []

    def load(self, before_epoch: int) -> None:
        """On resume: keep the rows of epochs before ``before_epoch`` (later ones belong to a discarded future)."""
        if os.path.isfile(self.path):
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["epoch"]) < before_epoch]

    @staticmethod
    def render(rows: List[Dict[str, Any]]) -> str:
        """The CSV text of ``rows`` (columns in order of first appearance)."""
        cols: List[str] = []
        for r in rows:
            cols += [k for k in r if k not in cols]
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue()

    def add(self, row: Dict[str, Any]) -> None:
        """Append ``row`` and rewrite the file on its own (the trainer instead commits :meth:`render`'s text)."""
        self.rows.append(row)
        atomic_write(self.path, self.render(self.rows))


def write_plot(rows: List[Dict[str, Any]], path: str, eval_metric: str) -> None:
    """Loss, the eval metric and the learning rate against epoch (matplotlib Agg), written atomically."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    def col(name):
        pts = [(int(r["epoch"]), float(r[name])) for r in rows if r.get(name) not in (None, "")]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for name in ("train_loss", "eval_loss"):
        axes[0].plot(*col(name), marker="o", label=name)
    axes[0].set_title("loss")
    for name in (f"eval_{eval_metric}", f"eval_ema_{eval_metric}"):
        if any(r.get(name) not in (None, "") for r in rows):
            axes[1].plot(*col(name), marker="o", label=name)
    axes[1].set_title(eval_metric)
    axes[2].plot(*col("lr"), marker="o", label="lr")
    axes[2].set_title("learning rate")
    for ax in axes:
        ax.set_xlabel("epoch")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
