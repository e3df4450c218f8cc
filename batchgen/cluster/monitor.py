"""What a running job looks like: per-worker metrics from the plugin's load view, and a progress bar.

    with batchgen.cluster.progress(client, total=len(df)):
        out = result.compute()
    batchgen.cluster.metrics(client)["workers"]   # coroutines, tokens/s, migrations per worker
"""
from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from ..progress import Mode, Progress
from .plugin import PLUGIN_NAME
from .worker import EXTENSION

if TYPE_CHECKING:
    from distributed import Client


def metrics(client: Client) -> dict[str, Any]:
    """The plugin's view: {"workers": {addr: {coroutines, waiting, running, remaining_tokens,
    kv_used, tokens_per_s, rows_done, generated_tokens, migrated_in, migrated_out, recovered,
    ...}}, "totals": {...}, "migrations": coroutines moved, "orders": ...}; {} without the plugin."""
    return client.run_on_scheduler(_metrics)


def _metrics(dask_scheduler: Any) -> dict[str, Any]:
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    return plugin.metrics() if plugin is not None else {}


def _departed(dask_scheduler: Any) -> dict[str, int]:
    """The plugin's counters of workers that left (in its totals)."""
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    return dict(plugin.counters.departed) if plugin is not None else {}


def _own_counters(dask_worker: Any) -> tuple[int, int]:
    """(rows done, tokens generated) of this worker's host, as of now; (0, 0) without one."""
    side = dask_worker.extensions.get(EXTENSION)
    if side is None:
        return 0, 0
    counters = side.host.counters
    return counters.rows_done, counters.generated_tokens


class progress:  # noqa: N801 - used as a context manager, like tqdm
    """Rows done, tokens/s and ETA of the cluster's batchgen work while the block runs.

    Counts rows finished by any batchgen task on the cluster since the block started (as the
    workers report them, every push interval). A bar on a terminal, a widget in a notebook
    (batchgen.progress), lines in a log.
    """

    def __init__(self, client: Client, total: int | None = None, *, interval: float = 0.5,
                 mode: Mode = "auto", file: TextIO | None = None, settle: float = 1.0) -> None:
        self.client, self.interval, self.settle = client, interval, settle
        self.bar = Progress(total, mode=mode, file=file)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="batchgen-progress", daemon=True)
        self._base: tuple[int, int] | None = None
        self._seen = (0, 0)

    def __enter__(self) -> Progress:
        self._base = self._read_now()
        self._thread.start()
        return self.bar

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        # the last rows reach the plugin with the workers' next pushes
        deadline = time.monotonic() + (self.settle if exc is None else 0.0)
        self._update()
        while self.bar.total is not None and self._seen[0] < self.bar.total and time.monotonic() < deadline:
            time.sleep(0.1)
            self._update()
        self.bar.close()

    def _read(self) -> tuple[int, int]:
        totals = metrics(self.client).get("totals", {})
        return int(totals.get("rows_done", 0)), int(totals.get("generated_tokens", 0))

    def _read_now(self) -> tuple[int, int]:
        """What `_read` will say once every worker has pushed what it has done until now: the
        workers' own counters (the plugin hears of them a push later, so a block started just
        after a job would otherwise count that job's last rows as its own), plus the plugin's
        counts of workers that left."""
        departed = self.client.run_on_scheduler(_departed)
        live = self.client.run(_own_counters).values()
        return (departed.get("rows_done", 0) + sum(rows for rows, _ in live),
                departed.get("generated_tokens", 0) + sum(tokens for _, tokens in live))

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            self._update()

    def _update(self) -> None:
        try:
            rows, tokens = self._read()
        except Exception:  # noqa: BLE001 - a display must never break the job
            return
        assert self._base is not None
        rows, tokens = rows - self._base[0], tokens - self._base[1]
        if rows > self._seen[0] or tokens > self._seen[1]:
            self.bar.update(rows=max(0, rows - self._seen[0]), tokens=max(0, tokens - self._seen[1]))
            self._seen = (max(rows, self._seen[0]), max(tokens, self._seen[1]))
