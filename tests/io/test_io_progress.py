"""Progress display: a tqdm bar on a terminal, periodic lines otherwise, tqdm's widget in a notebook."""
from __future__ import annotations

import io

from batchgen.progress import Progress, Snapshot, format_duration


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_when_not_a_tty() -> None:
    buf = io.StringIO()
    with Progress(10, initial=2, file=buf, interval=0) as p:
        p.update(3, tokens=30)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in buf.getvalue()
    assert lines[0].startswith("progress: 5/10 rows (50%)")
    assert "tok/s" in lines[0] and "ETA" in lines[0]


def test_bar_on_a_tty_redraws_in_place() -> None:
    buf = _Tty()
    p = Progress(4, file=buf, interval=0)
    p.update(1)
    p.update(1, tokens=10)
    p.close()
    p.close()  # idempotent
    text = buf.getvalue()
    frames = [f for f in text.rstrip("\n").split("\r") if "rows" in f]
    # one line, redrawn in place: no newline until the end
    assert text.endswith("\n") and text.count("\n") == 1 and len(frames) >= 3
    assert "1/4 rows (25%)" in frames[0] and "ETA" in frames[0]
    last = frames[-1]
    assert "2/4 rows (50%)" in last and "tok/s" in last
    # tqdm's bar: half of the 24 cells filled
    bar = last[last.index("|") + 1:last.index("|", 1)]
    assert len(bar) == 24 and bar[:12].strip() and not bar[12:].strip()


def test_off_and_unknown_total() -> None:
    buf = io.StringIO()
    with Progress(None, file=buf, mode="off", interval=0) as p:
        p.update(5, tokens=7)
        snap = p.snapshot()
    assert buf.getvalue() == ""
    assert (snap.done, snap.tokens, snap.eta) == (5, 7, None)
    assert "5 rows |" in snap.line()


def test_eta_counts_only_this_run() -> None:
    snap = Snapshot(done=60, total=100, tokens=500, elapsed=10.0, done_this_run=20)
    assert snap.eta == 20.0 and snap.tokens_per_s == 50.0
    assert format_duration(3725) == "1:02:05"


def test_auto_mode_outside_a_notebook_is_a_bar_on_a_tty_and_lines_in_a_log() -> None:
    from batchgen.progress import LineDisplay, TqdmDisplay, make_display

    assert isinstance(make_display("auto", io.StringIO()), LineDisplay)
    assert isinstance(make_display("auto", _Tty()), TqdmDisplay)
