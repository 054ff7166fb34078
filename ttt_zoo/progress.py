"""Progress of a long loop (an epoch, a validation pass, a prediction or sampling run, a benchmark): a tqdm bar
when the output is a terminal, else plain lines (a log file, a pipe).

    from ttt_zoo.progress import Progress
    with Progress(len(loader), "validate", interval=50) as progress:
        for x, y in loader:
            ...
            progress.update(items=x.shape[0], fields=lambda: {"top1": running_top1})

Lines come at the first step, every ``interval`` steps and at the last step, each with ``step/total``, the
phase's ETA, the run's ETA (when ``later_steps`` or ``later_s`` is given: the steps of the run after this phase,
at this phase's pace, plus ``later_s`` seconds known otherwise) and the throughput (``items`` per second)::

    train epoch 0 [5/22] eta 0:04 run eta 1:02 img/s 812 loss 2.1034 lr 0.001

A phase shorter than ``delay`` seconds prints nothing (no bar either; tqdm's ``delay``); a line that falls due
before then is dropped, and the first step after ``delay`` prints one.  ``fields`` is a callable so that its values
(a ``loss.item()`` that waits for the GPU) are read only when a line or the bar's postfix is due; an exception it
raises goes to the caller.  ``clock`` and ``stream`` are injectable for tests.  Only this module and tqdm
(``tqdm.format_interval``) format the times.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, Optional, TextIO

from tqdm import tqdm

__all__ = ["Progress", "DEFAULT_DELAY"]

#: seconds a phase runs before it shows progress ("longer than a few seconds"), read when a ``Progress`` without
#: ``delay`` starts (tests set it to 0); ``train`` passes 0
DEFAULT_DELAY = 5.0


def _format_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Progress:
    """Progress of ``total`` steps named ``desc`` (see the module's docstring).

    ``interval``: steps between two lines (the bar's postfix refreshes at the same steps); ``unit``: what ``items``
    counts (``img``: the throughput is ``img/s``); ``log``: where a line goes (default: a print to ``stream``);
    ``also_log``: where the lines go while a bar is shown (a log file keeps plain lines); ``enabled``: False shows nothing (a DDP rank other than 0); ``bar``: None picks a bar when ``stream`` is a
    terminal, True / False force it."""

    def __init__(self, total: int, desc: str, *, interval: int = 50, delay: Optional[float] = None,
                 unit: str = "img", later_steps: Optional[int] = None, later_s: Optional[float] = None,
                 log: Optional[Callable[[str], None]] = None, also_log: Optional[Callable[[str], None]] = None,
                 stream: Optional[TextIO] = None,
                 enabled: bool = True, bar: Optional[bool] = None, clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.interval, self.unit = int(total), desc, max(1, int(interval)), unit
        self.delay = DEFAULT_DELAY if delay is None else delay
        self.has_run = later_steps is not None or later_s is not None  # a run's phase: lines show the run's ETA
        self.later_steps, self.later_s = later_steps or 0, later_s or 0.0
        self.stream = stream if stream is not None else sys.stderr
        self.log = log if log is not None else (lambda line: print(line, file=self.stream, flush=True))
        self.also_log, self.enabled, self.clock = also_log, enabled, clock
        self.step = self.items = 0
        self.start = clock()
        self.printed = 0  # lines printed so far
        self.bar = None
        use_bar = bar if bar is not None else _is_terminal(self.stream)
        if enabled and use_bar:
            self.bar = tqdm(total=self.total, desc=desc, file=self.stream, delay=self.delay, leave=False,
                            dynamic_ncols=True, unit="step")

    # -- the arithmetic (one place) ---------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.start

    def eta(self) -> Optional[float]:
        """Seconds left in this phase at its pace so far (None before the first step)."""
        if self.step == 0:
            return None
        return (self.total - self.step) * self.elapsed() / self.step

    def run_eta(self) -> Optional[float]:
        """Seconds left in the run: this phase's, the ``later_steps`` at this phase's pace, and ``later_s``."""
        eta = self.eta()
        if eta is None:
            return None
        return eta + self.later_steps * self.elapsed() / self.step + self.later_s

    def rate(self) -> float:
        """``items`` per second over the phase so far."""
        return self.items / max(self.elapsed(), 1e-9)

    def due(self) -> bool:
        """Whether the step just counted gets a line: the first, every ``interval``-th and the last, once
        ``delay`` seconds have passed (then also the first step after it, when nothing was printed yet)."""
        if self.elapsed() < self.delay:
            return False
        scheduled = self.step == 1 or self.step % self.interval == 0 or self.step == self.total
        return scheduled or self.printed == 0

    def line(self, fields: Dict[str, Any]) -> str:
        parts = [f"{self.desc} [{self.step}/{self.total}]", f"eta {tqdm.format_interval(self.eta() or 0)}"]
        if self.has_run:
            parts.append(f"run eta {tqdm.format_interval(self.run_eta() or 0)}")
        parts.append(f"{self.unit}/s {self.rate():.0f}")
        parts += [f"{k} {_format_value(v)}" for k, v in fields.items()]
        return " ".join(parts)

    # -- use --------------------------------------------------------------------------------------------------
    def update(self, steps: int = 1, items: int = 0,
               fields: Optional[Callable[[], Dict[str, Any]]] = None) -> bool:
        """Count ``steps`` steps of ``items`` items; print a line (or refresh the bar's postfix) when one is due.
        Returns whether one was due (``fields`` was called then; with a bar: its postfix and ``also_log``)."""
        self.step += steps
        self.items += items
        if not self.enabled:
            return False
        if self.bar is not None:
            self.bar.update(steps)
        if not self.due():
            return False
        values = fields() if fields else {}
        if self.bar is None:
            self.log(self.line(values))
        else:
            extra = {"run_eta": tqdm.format_interval(self.run_eta() or 0)} if self.has_run else {}
            self.bar.set_postfix({f"{self.unit}/s": f"{self.rate():.0f}", **extra,
                                  **{k: _format_value(v) for k, v in values.items()}})
            if self.also_log is not None:
                self.also_log(self.line(values))
        self.printed += 1
        return True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False
