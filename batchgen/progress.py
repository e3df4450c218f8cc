"""Progress of a batch job: rows done / total, tokens/s, ETA.

One ``Progress`` object counts; a display shows it: a carriage-return bar on a terminal,
periodic lines when stderr is a file or pipe (logs stay readable), a widget in a notebook when
ipywidgets is installed. Thread-safe, so callbacks from another thread (a Dask client) can
update it.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, Protocol, TextIO

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
    if mode == "notebook":
        return NotebookDisplay()
    if mode == "bar":
        return BarDisplay(file)
    if mode == "lines":
        return LineDisplay(file)
    return None


class BarDisplay:
    """``\\r[######......]  120/1000 rows (12%) | 345.0 tok/s | 0:00:10 | ETA 0:01:23``"""

    def __init__(self, file: TextIO, width: int = 24) -> None:
        self.file, self.width = file, width

    def show(self, snap: Snapshot, final: bool) -> None:
        filled = int(self.width * snap.done / snap.total) if snap.total else 0
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] " if snap.total else ""
        cols = shutil.get_terminal_size((100, 20)).columns
        text = (bar + snap.line())[: cols - 1]
        self.file.write("\r" + text.ljust(cols - 1) + ("\n" if final else ""))
        self.file.flush()


class LineDisplay:
    def __init__(self, file: TextIO) -> None:
        self.file = file

    def show(self, snap: Snapshot, final: bool) -> None:
        self.file.write(f"progress: {snap.line()}\n")
        self.file.flush()


class NotebookDisplay:
    def __init__(self) -> None:
        import ipywidgets
        from IPython.display import display

        self.bar = ipywidgets.IntProgress(min=0, max=1)
        self.label = ipywidgets.Label()
        display(ipywidgets.HBox([self.bar, self.label]))

    def show(self, snap: Snapshot, final: bool) -> None:
        self.bar.max = snap.total or max(snap.done, 1)
        self.bar.value = snap.done
        self.label.value = snap.line()
        if final:
            self.bar.bar_style = "success"


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _isatty(file: TextIO) -> bool:
    try:
        return file.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _in_notebook() -> bool:
    if "IPython" not in sys.modules:
        return False
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
