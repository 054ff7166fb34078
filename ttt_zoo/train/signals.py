"""Ctrl-C (SIGINT) and SIGTERM stop a run between two steps, never inside a commit: the handler only records the
signal; the loop raises :class:`Stopped` at its next step, and ``ttt-zoo train`` exits 130 / 143 with one line."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Dict

__all__ = ["Stopped", "signals_set_flag", "STOP_SIGNALS"]


class Stopped(Exception):
    """Ctrl-C (SIGINT) or SIGTERM stopped the run between two steps; ``str()`` is the one line to print."""

    def __init__(self, signum: int, line: str):
        super().__init__(line)
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_set_flag(flag: Dict[str, int]):
    """While the run lasts, SIGINT / SIGTERM only record themselves in ``flag``: the loop stops at its next step
    (so a commit in progress always completes). Only the main thread can own signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def record(signum, _frame):
        flag.setdefault("signum", signum)
    old = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
