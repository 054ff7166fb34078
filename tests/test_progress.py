"""ttt_zoo.progress: the schedule of progress lines, their ETA arithmetic (a fake clock, never the wall clock), the
quiet phase under the delay, and a tqdm bar on a pseudo-terminal against plain lines in a file."""
import io
import os
import re
import select

import pytest

from ttt_zoo.progress import Progress


class FakeClock:
    def __init__(self, step_s: float):
        self.now, self.step_s = 100.0, step_s

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.step_s


def _run(total, interval, step_s=0.5, delay=0.0, items=8, **kw):
    """Lines of a phase of ``total`` steps that each take ``step_s`` seconds of the fake clock."""
    clock, lines, called = FakeClock(step_s), [], []
    p = Progress(total, "train epoch 0", interval=interval, delay=delay, log=lines.append, bar=False, clock=clock,
                 **kw)
    for _ in range(total):
        clock.tick()
        p.update(items=items, fields=lambda: called.append(p.step) or {"loss": "2.0000"})
    return lines, called


def _steps(lines):
    return [int(re.search(r"\[(\d+)/\d+\]", line).group(1)) for line in lines]


@pytest.mark.parametrize("interval,expected", [(50, [1, 22]), (5, [1, 5, 10, 15, 20, 22]), (1, list(range(1, 23))),
                                               (22, [1, 22]), (11, [1, 11, 22])])
def test_line_schedule_first_every_interval_last(interval, expected):
    lines, called = _run(22, interval)
    assert _steps(lines) == expected
    assert called == expected  # fields (a loss.item()) are read only for a line
    assert all(line.startswith(f"train epoch 0 [{s}/22] ") for s, line in zip(expected, lines))


def test_eta_arithmetic_against_a_fake_clock():
    clock = FakeClock(0.5)
    p = Progress(22, "e", interval=5, delay=0, later_steps=44, later_s=3.0, log=lambda _: None, bar=False, clock=clock)
    assert p.eta() is None and p.run_eta() is None  # no pace before the first step
    for _ in range(5):
        clock.tick()
        p.update(items=16)
    # 5 steps in 2.5 s: 17 steps left in the phase, 44 later ones at the same pace, plus 3 s
    assert p.eta() == pytest.approx(17 * 0.5)
    assert p.run_eta() == pytest.approx(17 * 0.5 + 44 * 0.5 + 3.0)
    assert p.rate() == pytest.approx(5 * 16 / 2.5)
    line = p.line({"loss": "2.1034", "lr": 0.001})
    assert line == "e [5/22] eta 00:08 run eta 00:33 img/s 32 loss 2.1034 lr 0.001"


def test_eta_in_hours_and_no_run_eta_without_later_work():
    lines, _ = _run(22, 50, step_s=600.0)  # 10 min a step: 21 steps left after the first = 3.5 h
    assert lines[0].startswith("train epoch 0 [1/22] eta 3:30:00 img/s ") and "run eta" not in lines[0]
    assert lines[-1].startswith("train epoch 0 [22/22] eta 00:00 ")


def test_quiet_phase_under_the_delay_prints_nothing():
    lines, called = _run(22, 5, step_s=0.1, delay=5.0)  # 2.2 s in all
    assert lines == [] and called == []


def test_phase_past_the_delay_prints_from_the_first_step_after_it():
    lines, _ = _run(22, 50, step_s=1.0, delay=5.0)  # step 5 ends at 5 s: its line, then the last
    assert _steps(lines) == [5, 22]
    lines, _ = _run(22, 5, step_s=1.0, delay=7.5)  # step 8 is the first after the delay; then 10, 15, 20, 22
    assert _steps(lines) == [8, 10, 15, 20, 22]


def test_default_delay_is_read_when_a_phase_starts(monkeypatch):
    import ttt_zoo.progress as progress
    monkeypatch.setattr(progress, "DEFAULT_DELAY", 0.0)
    assert Progress(3, "x", bar=False).delay == 0.0
    monkeypatch.setattr(progress, "DEFAULT_DELAY", 9.0)
    assert Progress(3, "x", bar=False).delay == 9.0


def test_disabled_prints_nothing_and_reads_no_fields():
    lines, called = _run(22, 5, enabled=False)
    assert lines == [] and called == []


def test_plain_lines_in_a_file(tmp_path):
    path = tmp_path / "log.txt"
    clock = FakeClock(0.5)
    with open(path, "w") as f:
        assert not f.isatty()
        with Progress(12, "validate", interval=5, delay=0, stream=f, clock=clock) as p:
            assert p.bar is None  # a file: no bar
            for _ in range(12):
                clock.tick()
                p.update(items=4)
    text = path.read_text()
    assert "\r" not in text and "\x1b" not in text
    assert _steps(text.splitlines()) == [1, 5, 10, 12]


def test_bar_on_a_pseudo_terminal():
    import fcntl
    import struct
    import termios
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    also = []
    try:
        with open(slave, "w", closefd=True) as tty:
            assert tty.isatty()
            with Progress(12, "validate", interval=5, delay=0, stream=tty, also_log=also.append) as p:
                assert p.bar is not None  # tqdm's bar, not lines
                for _ in range(12):
                    p.update(items=4, fields=lambda: {"top1": 50.0})
            tty.flush()
            out = b""
            while True:  # what tqdm drew on the terminal
                if not select.select([master], [], [], 0.5)[0]:
                    break
                chunk = os.read(master, 65536)
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(master)
    text = out.decode("utf-8", "replace")
    assert "\r" in text and "validate" in text and "12/12" in text and "top1=50" in text
    assert not re.search(r"validate \[\d+/12\] eta", text)  # no plain lines on the terminal
    assert _steps(also) == [1, 5, 10, 12]  # the same lines go to the log file beside the bar


def test_bad_stream_is_no_terminal():
    closed = io.StringIO()
    closed.close()
    assert Progress(3, "x", stream=closed, log=lambda _: None).bar is None
