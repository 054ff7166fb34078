"""What several ``ttt-zoo`` commands share: the model-constructor flags, output checks and the error boundary."""

import argparse
import contextlib
import errno
import json
import os
import re
import sys
import tempfile
import traceback
from typing import Any, Dict, Iterable, Optional

from ttt_zoo.errors import USER_ERRORS, UsageError  # noqa: F401  (UsageError re-exported)
from ttt_zoo.flags import model_kwargs_problem

__all__ = ["add_model_kwargs", "model_kwargs", "cli_errors", "UsageError", "UserExit", "run_command",
           "check_out", "check_out_folder", "error_line", "INTERRUPTED", "interrupted_line"]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ttt_zoo/


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--model-args must be a JSON object, e.g. '{{\"depth\": 2}}' ({e})")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--model-args must be a JSON object, e.g. '{\"depth\": 2}'")
    why = model_kwargs_problem(value)
    if why:
        raise argparse.ArgumentTypeError(why)
    return value


def add_model_kwargs(p: argparse.ArgumentParser) -> None:
    """``--model-kwargs K=V ...`` (timm's train.py spelling, values parsed as Python literals) and its JSON form
    ``--model-args '{...}'``; read both with :func:`model_kwargs`."""
    from ttt_zoo.flags import ModelKwargs
    p.add_argument("--model-kwargs", nargs="*", default={}, action=ModelKwargs, metavar="K=V",
                   help="model constructor arguments, e.g. depth=4 embed_dim=96 (as for `ttt-zoo train`)")
    p.add_argument("--model-args", type=_json_object, default=None, metavar="JSON",
                   help="the same as a JSON object, e.g. '{\"depth\": 4, \"embed_dim\": 96}'")


def model_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The constructor arguments of :func:`add_model_kwargs` (``--model-kwargs`` wins on a clash)."""
    return dict(args.model_args or {}, **dict(args.model_kwargs or {}))


# ----- outputs: never into a run folder, never overwritten without --force, checked before the work -----

def _refuse_run(path: str, flag: str) -> None:
    """Only ``ttt-zoo train`` writes into a run folder (see :func:`ttt_zoo.run_folder.refuse_run_output`)."""
    from ttt_zoo.run_folder import refuse_run_output
    refuse_run_output(path, flag)


def _probe_folder(folder: str, flag: str, path: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write to {folder} ({e.strerror or e}); choose another {flag}")


def check_out(path: str, force: bool, flag: str = "--out") -> None:
    """Refuse a ``path`` in a run folder (whatever ``force`` says), an existing ``path`` without ``--force``, and a
    folder we cannot write to, before any work."""
    _refuse_run(path, flag)
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give a file name")
    if os.path.exists(path) and not force:
        raise UsageError(f"{flag} {path} already exists; add --force to replace it, or choose another {flag}")
    _probe_folder(os.path.dirname(os.path.abspath(path)), flag, path)


def check_out_folder(folder: str, names: Iterable[str], force: bool, flag: str = "--output",
                     create: bool = True) -> None:
    """Like :func:`check_out` for a folder that will receive ``names`` (created now; ``create=False``: only its
    parent, for a writer that creates the folder itself)."""
    _refuse_run(folder, flag)
    there = [n for n in names if os.path.exists(os.path.join(folder, n))]
    if there and not force:
        raise UsageError(f"{flag} {folder} already holds {', '.join(there)}; add --force to replace them, or "
                         f"choose another {flag}")
    where = os.path.abspath(folder)
    _probe_folder(where if create else os.path.dirname(where), flag, folder)


# ----- the boundary: one line per user error, a traceback only with --debug -----

def _raised_in_zoo(e: BaseException) -> bool:
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(_PKG + os.sep)


def _command_args(e: BaseException, args: Iterable[Any] = ()) -> Optional[argparse.Namespace]:
    """The command's parsed arguments: one given to :func:`run_command`, else the ``args`` of a frame the error
    passed through (``ttt_zoo.cli.main`` parses inside the boundary)."""
    for a in args:
        if isinstance(a, argparse.Namespace):
            return a
    tb = e.__traceback__
    while tb is not None:
        ns = tb.tb_frame.f_locals.get("args")
        if isinstance(ns, argparse.Namespace):
            return ns
        tb = tb.tb_next
    return None


def _hub_message(e: BaseException, args: Optional[argparse.Namespace]) -> Optional[str]:
    """A model the Hugging Face Hub could not give (offline without a cached copy, no network, no such repo: the
    OSErrors of huggingface_hub, raised under timm): :func:`ttt_zoo.checkpoint.hub_unavailable_error`'s message,
    naming the repo of the ``hf-hub:`` name given (else the hub id of the ``--model``'s pretrained weights)."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    hub = next((x for x in chain if isinstance(x, OSError) and type(x).__module__.split(".")[0] == "huggingface_hub"),
               None)
    if hub is None:
        return None
    spaces, tb = [args], chain[0].__traceback__
    while tb is not None:  # `ttt-zoo train` parses its own flags below the command's: every Namespace on the way
        spaces.append(tb.tb_frame.f_locals.get("args"))
        tb = tb.tb_next
    given = []
    for ns in spaces:
        for flag in ("model", "checkpoint", "initial_checkpoint"):
            value = getattr(ns, flag, None) if isinstance(ns, argparse.Namespace) else None
            given += value if isinstance(value, list) else [value]
    given = [v for v in given if isinstance(v, str) and v]
    repo = next((v[len("hf-hub:"):].split("@")[0] for v in given if v.startswith("hf-hub:")), None)
    if repo is None and given:  # a registered name's pretrained weights
        import timm
        try:
            repo = getattr(timm.models.get_pretrained_cfg(given[0]), "hf_hub_id", None)
        except Exception:  # noqa: BLE001 - not a registered name: the repo stays unnamed
            repo = None
    from ttt_zoo.checkpoint import hub_unavailable_error
    return str(hub_unavailable_error(repo or "(unknown)", "the model", hub))


def error_line(e: BaseException, args: Optional[argparse.Namespace] = None) -> Optional[str]:
    """The one-line message of a user error, or None for a crash (a bug: keep the traceback). ``args``: the
    command's arguments, for a failed allocation's line (the --img-size / -b that fit)."""
    from ttt_zoo.flags import out_of_memory
    oom = out_of_memory(e, getattr(args, "img_size", None), getattr(args, "batch_size", None))
    if oom is not None:
        msg = oom
    elif isinstance(e, SystemExit):
        if not isinstance(e.code, str):
            return None
        msg = e.code
    elif isinstance(e, USER_ERRORS):
        msg = str(e)
    elif (hub := _hub_message(e, args)) is not None:  # before OSError: huggingface_hub's errors are OSErrors
        msg = hub
    elif isinstance(e, OSError) and e.filename is not None and e.errno in (errno.ENOSPC, errno.EDQUOT):
        msg = f"{e.filename}: no space left on its disk ({e.strerror}); free some space, then run the command again"
    elif isinstance(e, OSError) and e.filename is not None:
        msg = f"{e.filename}: {e.strerror or e}; check the path and its permissions"
    elif isinstance(e, (ValueError, OSError)) and _raised_in_zoo(e):  # our own clear messages
        msg = str(e)
    else:
        return None
    msg = " ".join(msg.split())  # one line
    msg = re.sub(r"^(?:ttt-zoo[\w\- ]*: )?error: ", "", msg)  # "ttt-zoo train: error: ..." -> "..."
    return f"error: {msg}"


def _usage_error(self, message):  # argparse's error(): one line instead of usage + message
    raise UsageError(f"{self.prog}: {message}; see `{self.prog} --help`")


@contextlib.contextmanager
def _one_line_parser_errors():
    old = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _usage_error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = old


class UserExit(SystemExit):
    """Exit status 2 after the one ``error:`` line was printed; ``str()`` is that line."""

    def __init__(self, line: str):
        super().__init__(2)
        self.line = line

    def __str__(self) -> str:
        return self.line


INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT), as `ttt-zoo train` and shells use


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that every ``finally`` runs (temp files and staged folders removed)."""


def interrupted_line(start: int = 0, why: str = "interrupted (Ctrl-C)") -> str:
    """The one line after Ctrl-C: what was kept. Every output is written whole or not at all (a temp file renamed
    when complete), so the files published since ``start`` are complete and nothing else was written."""
    from ttt_zoo.fileio import published
    done = list(dict.fromkeys(published(start)))
    if not done:
        return f"error: {why}; nothing was written"
    shown = ", ".join(done[:3]) + (f" and {len(done) - 3} more" if len(done) > 3 else "")
    return (f"error: {why}; written in full before it and kept: {shown}; nothing else was written "
            f"(run the command again for the rest)")


@contextlib.contextmanager
def _sigterm_raises():
    """While a command runs, SIGTERM raises :class:`Terminated` (the default would end the process at once and
    leave its temp files); only where nothing else handles SIGTERM, and only in the main thread."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def raise_terminated(signum, _frame):
        raise Terminated()
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_command(fn, *args, debug: bool = False) -> int:
    """Call ``fn(*args)``; a user error prints one ``error:`` line on stderr (``debug``: the traceback first) and
    raises :class:`UserExit` (exit status 2, no traceback). Crashes (bugs) keep their traceback. Ctrl-C prints one
    line saying what was kept and returns :data:`INTERRUPTED` (130); SIGTERM the same, exit status 143."""
    from ttt_zoo.fileio import published
    start = len(published())
    try:
        with _one_line_parser_errors(), _sigterm_raises():
            return fn(*args)
    except UserExit:
        raise
    except KeyboardInterrupt as e:
        if debug:
            traceback.print_exc()
        term = isinstance(e, Terminated)
        print(interrupted_line(start, "stopped (SIGTERM)" if term else "interrupted (Ctrl-C)"), file=sys.stderr)
        return 143 if term else INTERRUPTED
    except BrokenPipeError:  # the reader stopped early (`ttt-zoo list | head`): quiet, as shell tools are
        try:  # the interpreter's final flush must not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (AttributeError, OSError, ValueError):  # stdout is not a file (e.g. captured)
            pass
        return 0
    except (Exception, SystemExit) as e:
        if isinstance(e, SystemExit) and not isinstance(e.code, str):
            raise
        line = error_line(e, _command_args(e, args))
        if line is None:
            raise
        if debug:
            traceback.print_exc()
        print(line, file=sys.stderr)
        raise UserExit(line) from None


def cli_errors(fn):
    """A command that returns 2 (instead of raising :class:`UserExit`) after its one-line error."""
    def run(args) -> int:
        try:
            return run_command(fn, args, debug=getattr(args, "debug", False))
        except UserExit:
            return 2
    return run
