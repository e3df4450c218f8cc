"""Progress display: a carriage-return bar on a terminal, periodic lines otherwise."""
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
    p.update(1)
    p.close()
    p.close()  # idempotent
    text = buf.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "[############............] 2/4 rows" in text


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
