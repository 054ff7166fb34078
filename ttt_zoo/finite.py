"""Non-finite results are errors, never results: model outputs checked before they become numbers, and JSON written
only when it is valid JSON (no ``NaN`` / ``Infinity``)."""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

from .errors import UsageError

__all__ = ["FiniteCheck", "json_dumps", "first_non_finite"]

_FIX = "the weights give no finite output (a diverged run, or a damaged file?); check the --checkpoint"


class FiniteCheck:
    """Counts the samples whose output has a NaN or an infinity, batch by batch; :meth:`check` raises one
    :class:`UsageError` line naming how many and the first, e.g. ``model output has NaN for 20 of 20 images (first:
    data/val/3/x.png)``."""

    def __init__(self, what: str = "model output", unit: str = "images", fix: str = _FIX):
        self.what, self.unit, self.fix = what, unit, fix
        self.bad = self.total = 0
        self.first: Optional[str] = None
        self.kinds = set()

    def add(self, out, name_of: Callable[[int], str]) -> None:
        """``out``: (batch, ...) outputs; ``name_of(i)``: what sample i of this batch is (a file name)."""
        if out.shape[0] == 0:
            return
        flat = out.detach().reshape(out.shape[0], -1).float()
        nan, inf = flat.isnan().any(1), flat.isinf().any(1)
        bad = (nan | inf).nonzero().flatten().tolist()
        if bad:
            if self.first is None:
                self.first = name_of(bad[0])
            self.kinds |= {"NaN"} if bool(nan.any()) else set()
            self.kinds |= {"an infinity"} if bool(inf.any()) else set()
        self.bad += len(bad)
        self.total += int(flat.shape[0])

    def check(self) -> None:
        if self.bad:
            raise UsageError(f"{self.what} has {' or '.join(sorted(self.kinds))} for {self.bad} of {self.total} "
                             f"{self.unit} (first: {self.first}); nothing was reported or written: {self.fix}")


def first_non_finite(obj: Any, where: str = "") -> Optional[str]:
    """``'[3].top1 = nan'`` for the first float that is not finite in nested lists / dicts, else None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return f"{where or 'the value'} = {obj}"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = first_non_finite(v, f"{where}.{k}" if isinstance(obj, dict) else f"{where}[{k}]")
        if found:
            return found
    return None


def json_dumps(obj: Any, what: str = "the results", **kwargs) -> str:
    """``json.dumps`` that never writes ``NaN`` / ``Infinity`` (not JSON): one :class:`UsageError` line naming the
    first such value instead."""
    found = first_non_finite(obj)
    if found:
        raise UsageError(f"{what} hold a value that is not a finite number ({found.lstrip('.')}), which JSON "
                         f"cannot hold; nothing was written")
    return json.dumps(obj, allow_nan=False, **kwargs)
