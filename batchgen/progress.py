"""Progress of a batch job: rows done / total, tokens/s, ETA.

One ``Progress`` object counts; a display shows it: a tqdm bar on a terminal, tqdm's notebook
widget in Jupyter (``tqdm.auto``'s choice; needs ipywidgets), periodic plain lines when stderr is
a file or pipe (a tqdm bar there is a stream of carriage returns: logs stay readable this way).
Thread-safe, so callbacks from another thread (a Dask client) can update it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TextIO

Mode = Literal["auto", "bar", "lines", "notebook", "off"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    done: int  # rows, including those done before this run
    total: int | None
    tokens: int  # generated this run
    elapsed: float  # seconds
    done_this_run: int
    status: str = ""  # a backend's own figures (expert hit rates), appended to the line

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        if self.total is None or self.done_this_run == 0:
            return None
        return (self.total - self.done) * self.elapsed / self.done_this_run

    def line(self) -> str:
        of = f"/{self.total}" if self.total is not None else ""
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        eta = f" | ETA {format_duration(self.eta)}" if self.eta is not None else ""
        status = f" | {self.status}" if self.status else ""
        return (f"{self.done}{of} rows{pct} | {self.tokens_per_s:,.1f} tok/s | "
                f"{format_duration(self.elapsed)}{eta}{status}")


class Display(Protocol):
    def show(self, snap: Snapshot, final: bool) -> None: ...


class Progress:
    """Count rows and generated tokens; ``update`` is cheap, the display is rate-limited."""

    def __init__(self, total: int | None, *, initial: int = 0, mode: Mode = "auto",
                 file: TextIO | None = None, interval: float | None = None,
                 status: Callable[[], str] | None = None) -> None:
        """status: called at each display for extra figures to show (cheap, same thread)."""
        self.total, self._initial, self._done, self._tokens = total, initial, initial, 0
        self._status = status
        self._start = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._display = make_display(mode, file or sys.stderr)
        self._interval = interval if interval is not None else (
            10.0 if isinstance(self._display, LineDisplay) else 0.1)
        self._closed = False

    def update(self, rows: int = 1, tokens: int = 0) -> None:
        with self._lock:
            self._done += rows
            self._tokens += tokens
            now = time.monotonic()
            if self._display is not None and now - self._last >= self._interval:
                self._last = now
                self._display.show(self.snapshot(), final=False)

    def snapshot(self) -> Snapshot:
        return Snapshot(self._done, self.total, self._tokens, time.monotonic() - self._start,
                        self._done - self._initial, self._status() if self._status is not None else "")

    def close(self) -> None:
        with self._lock:
            if not self._closed and self._display is not None:
                self._display.show(self.snapshot(), final=True)
            self._closed = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_display(mode: Mode, file: TextIO) -> Display | None:
    if mode == "auto":
        mode = "notebook" if _in_notebook() else "bar" if _isatty(file) else "lines"
    if mode in ("bar", "notebook"):
        return TqdmDisplay(file, notebook=mode == "notebook")
    if mode == "lines":
        return LineDisplay(file)
    return None


class TqdmDisplay:
    """``|████▌      | 120/1000 rows (12%) | 345.0 tok/s | 0:00:10 | ETA 0:01:23``: tqdm draws
    (terminal width, redraw in place, the notebook widget); the counts and the text are ours,
    so a resumed job's rows, tokens/s of this run and a backend's status read as in a log line."""

    def __init__(self, file: TextIO, *, notebook: bool = False, width: int = 24) -> None:
        if notebook:
            from tqdm.notebook import tqdm
        else:
            from tqdm import tqdm
        self.bar = tqdm(total=None, file=file, bar_format=f"|{{bar:{width}}}| {{postfix}}",
                        dynamic_ncols=not notebook, leave=True, mininterval=0)
        self._closed = False

    def show(self, snap: Snapshot, final: bool) -> None:
        if self._closed:
            return
        total = snap.total or None
        if total != self.bar.total:
            self.bar.reset(total=total)  # also sets the notebook widget's max
        self.bar.n = snap.done
        self.bar.set_postfix_str(snap.line(), refresh=False)
        self.bar.refresh()
        if final:
            self._closed = True
            self.bar.close()


class LineDisplay:
    def __init__(self, file: TextIO) -> None:
        self.file = file

    def show(self, snap: Snapshot, final: bool) -> None:
        self.file.write(f"progress: {snap.line()}\n")
        self.file.flush()


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _isatty(file: TextIO) -> bool:
    try:
        return file.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _in_notebook() -> bool:
    """tqdm.auto's choice: its notebook widget in a Jupyter kernel with ipywidgets (without
    ipywidgets tqdm warns and picks the console bar)."""
    if "ipykernel" not in sys.modules:  # the cheap common case: no import of tqdm.auto
        return False
    from tqdm.auto import tqdm
    from tqdm.notebook import tqdm_notebook

    return issubclass(tqdm, tqdm_notebook)
