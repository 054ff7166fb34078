"""Every numeric flag of every ``ttt-zoo`` command with its declared range (:class:`ttt_zoo.flags.Range`), read from
the parsers themselves: ``tests/test_flag_ranges.py`` walks them, ``experiments/flag_ranges_table.py`` tables them."""
import argparse
from typing import Iterator, List, NamedTuple, Optional

from ttt_zoo.flags import Range, range_of

__all__ = ["NumericFlag", "numeric_flags", "NOT_NUMERIC"]

#: argparse types that take text other than a number (the test refuses any other untyped-by-Range type)
NOT_NUMERIC = ("_json_object", "_kwarg", "_layers")


class NumericFlag(NamedTuple):
    command: List[str]  # e.g. ["train", "--task", "sd3"] or ["data", "digits"]
    flag: str  # the long option string
    action: argparse.Action
    range: Optional[Range]  # None: a numeric flag without a declared range (a bug the test reports)

    @property
    def nargs(self) -> int:
        return self.action.nargs if isinstance(self.action.nargs, int) else 1


def _is_numeric(action: argparse.Action) -> bool:
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._StoreConstAction,
                           argparse._CountAction, argparse._VersionAction)):
        return False
    if range_of(action) is not None or action.type in (int, float):
        return True
    if action.type not in (None, str) and getattr(action.type, "__name__", "") not in NOT_NUMERIC:
        return True  # an unknown converter: declare its range or list it in NOT_NUMERIC
    d = action.default
    return isinstance(d, (int, float)) and not isinstance(d, bool)


def _walk(parser: argparse.ArgumentParser, command: List[str]) -> Iterator[NumericFlag]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, command + [name])
        elif _is_numeric(action):
            yield NumericFlag(command, max(action.option_strings, key=len), action, range_of(action))


def numeric_flags() -> List[NumericFlag]:
    """Every numeric flag of every command; ``train``'s for every ``--task`` (its own parser, flags shared by the
    tasks listed once)."""
    from ttt_zoo.cli import build_parser
    from ttt_zoo.train.args import build_parser as train_parser
    from ttt_zoo.train.task import TASKS, get_task_class
    out = [f for f in _walk(build_parser(), []) if f.command[:1] != ["train"]]
    seen = set()
    for task in sorted(TASKS):
        for f in _walk(train_parser(get_task_class(task)), ["train", "--task", task]):
            key = (f.flag, repr(f.range), repr(f.action.default))
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out
