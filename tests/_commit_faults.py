"""Fault injection for the kill tests: hold a training process inside the commit of one epoch, at one stage, so
that the test can kill it exactly there.  Nothing of this is in the package: :func:`install` wraps, in the process
under test, the file operations the commit calls (``ttt_zoo.run_folder.commit``'s ``fsync_file`` / ``write_file`` /
``replace_file``) and its ``commit_epoch`` itself.

Stages, in order (``pause`` is ``"<epoch>:<stage>"``): ``wrote:<name>`` (that temp file complete), ``written``
(every temp and the manifest's temp complete, nothing renamed), ``committed`` (the manifest renamed: the commit),
``renamed:<name>`` (that file published; ``renamed`` is the first one, ``last.state.pt``), ``published`` (all);
and ``0:setup``: the run folder and its args.yaml are written, no step was taken (the disk check of the setup).
At the stage the process writes the marker file ``SAVE_PAUSED`` (holding the stage) into the run folder and
waits until the test kills it, or deletes the marker to let it go on.

In a child process: :func:`train_child` (``install(pause)``, then the trainer).  As a command: :func:`command`
gives the argv of ``python tests/_commit_faults.py PAUSE train ...`` (``ttt-zoo`` with the pause installed).
"""
import os
import sys
import time
import traceback

MARKER = "SAVE_PAUSED"


def install(pause: str) -> None:
    from ttt_zoo import run_folder
    from ttt_zoo.run_folder import commit
    from ttt_zoo.train import run_state
    want_epoch, want_stage = pause.split(":", 1)
    now = {"epoch": None, "folder": None, "renamed": 0}

    def hold(stage: str) -> None:
        if now["epoch"] is not None and str(now["epoch"]) == want_epoch and stage == want_stage:
            marker = os.path.join(now["folder"], MARKER)
            with open(marker, "w") as f:
                f.write(stage)
            deadline = time.monotonic() + 600
            while os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.02)

    def after(real, stage_of):
        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            if now["epoch"] is not None:
                for stage in stage_of(*args):
                    hold(stage)
            return out
        return wrapped

    def name_of(path: str) -> str:
        return os.path.basename(path)[: -len(run_folder.TMP)] if path.endswith(run_folder.TMP) else ""

    def renamed(tmp: str, path: str):
        now["renamed"] += 1
        return (["renamed"] if now["renamed"] == 1 else []) + [f"renamed:{os.path.basename(path)}"]

    manifest_tmp = lambda: run_folder.manifest_path(now["folder"]) + run_folder.TMP  # noqa: E731
    commit.fsync_file = after(commit.fsync_file, lambda p: [f"wrote:{name_of(p)}"])
    commit.write_file = after(commit.write_file, lambda p, *a: ["written"] if p == manifest_tmp() else [])
    commit.replace_file = after(commit.replace_file, lambda t, p: ["committed"] if p == run_folder.manifest_path(
        now["folder"]) else renamed(t, p))
    real_check = run_state.check_output_dir

    def check_output_dir(folder, *args, **kwargs):
        real_check(folder, *args, **kwargs)
        now.update(epoch=0, folder=folder)
        try:
            hold("setup")
        finally:
            now["epoch"] = None
    run_state.check_output_dir = check_output_dir
    real_commit = commit.commit_epoch

    def commit_epoch(folder, state, *args, **kwargs):
        now.update(epoch=int(state["epoch"]), folder=folder, renamed=0)
        try:
            real_commit(folder, state, *args, **kwargs)
            hold("published")
        finally:
            now["epoch"] = None
    commit.commit_epoch = commit_epoch


def train_child(argv: list, pause, hold: bool, log: str) -> None:
    """A training run as a child process, forked from a forkserver that imported torch and the trainer once (a
    fresh interpreter per run costs seconds; a fork of a process whose autograd engine has started its threads
    cannot run autograd): one torch thread, ``install(pause)`` when given, ``ttt-zoo train ARGV``, its output
    into ``log``; with ``hold``, a finished run waits to be killed.  Exits with the trainer's status."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        import torch
        torch.set_num_threads(1)
        if pause:
            install(pause)
        from ttt_zoo.train.trainer import main
        code = main(argv)
        if hold and code == 0:
            time.sleep(600)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def command(pause: str, *argv: str) -> list:
    """The argv of ``ttt-zoo ARGV...`` in a new interpreter with the pause installed."""
    return [sys.executable, os.path.abspath(__file__), pause, *argv]


if __name__ == "__main__":
    install(sys.argv[1])
    from ttt_zoo.cli import main
    sys.exit(main(sys.argv[2:]))
