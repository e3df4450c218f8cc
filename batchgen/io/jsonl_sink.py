"""Resumable OpenAI batch JSONL output.

A local file is appended to, flushed and fsynced per batch of finished lines: a SIGKILL can
leave at most a torn last line, which ``--resume`` cuts off before reading the keys of every
complete line as done. On object storage, where nothing appends, ``JsonlPartsSink`` writes
each batch as a whole part object under ``<output>.parts/`` and the commit streams them into
``<output>``, so a reader never sees a half-written output as complete.
With ``retry``, lines that ended in a retryable error are dropped and their rows run again.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.errors import BatchgenError
from batchgen.io.openai_batch import error_record, is_retryable, record_error, record_key, success_record
from batchgen.io.request import Request, RowKey
from batchgen.io.storage import Location, write_atomic

if TYPE_CHECKING:
    from batchgen.outputs import RequestOutput
    from batchgen.tokenizer import Tokenizer


class JsonlSink:
    flush_rows = 32

    def __init__(self, path: Path, *, model: str, resume: bool,
                 tokenizer: Tokenizer | None = None, retry: bool = False) -> None:
        self.path, self.model, self.tokenizer = Path(path), model, tokenizer
        self.done: set[RowKey] = set()
        self.done_failed = 0  # of ``done``: rows that ended in an error
        if resume and self.path.exists():
            self.done, self.done_failed = read_back(self.path, retry)
        self._buffer: list[str] = []
        self._file = open(self.path, "ab" if resume else "wb")

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def add_result(self, req: Request, out: RequestOutput) -> None:
        self.add_record(success_record(req, out, req.model or self.model, self.tokenizer))

    def add_error(self, req: Request) -> None:
        self.add_record(error_record(req))

    def add_record(self, record: dict[str, Any]) -> None:
        """Buffer one output line (a record of ``openai_batch``'s shape, so that resume reads its key)."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (valid JSON escape, not UTF-8): keep it escaped
            line = json.dumps(record, ensure_ascii=True) + "\n"
        self._buffer.append(line)

    def flush(self) -> None:
        if self._buffer:
            self._file.write("".join(self._buffer).encode("utf-8"))
            self._buffer.clear()
            self._file.flush()
            os.fsync(self._file.fileno())

    def commit(self) -> None:
        self.flush()
        self._file.close()

    def close(self) -> None:
        """Keep what is finished; the file stays resumable."""
        if not self._file.closed:
            self.commit()


def recover(path: Path) -> set[RowKey]:
    """Keys of the complete lines of ``path``; a torn last line is truncated away."""
    return read_back(path)[0]


def read_back(path: Path, retry: bool = False) -> tuple[set[RowKey], int]:
    """Keys of the complete lines of ``path`` and how many of them are errors; a torn last line
    is truncated away. ``retry``: retryable error lines are dropped (the file is rewritten
    without them under a temporary name and renamed into place) and not counted as done."""
    done: set[RowKey] = set()
    failed = dropped = 0
    good_end = 0
    with open(path, "r+b") as f:
        for number, raw in enumerate(f, start=1):
            record = _parse(raw) if raw.endswith(b"\n") else None
            if record is None:
                if f.read(1):  # not the last line: not a torn write, so not ours to cut
                    raise BatchgenError(f"cannot resume: line {number} of {path} is not a "
                                        "batchgen output record; use --overwrite to start over")
                break
            good_end += len(raw)
            if retry and is_retryable(record):
                dropped += 1
                continue
            done.add(record_key(record))
            failed += record_error(record) is not None
        f.truncate(good_end)
    if dropped:
        _drop_retryable(path)
    return done, failed


def _drop_retryable(path: Path) -> None:
    tmp = path.with_name(f".{path.name}.retry.tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for raw in src:
            record = _parse(raw)
            if record is None or not is_retryable(record):
                dst.write(raw)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


class JsonlPartsSink(JsonlSink):
    """JSONL on a filesystem that cannot append (object storage): parts, then one commit."""

    def __init__(self, loc: Location, *, model: str, resume: bool, tokenizer: Tokenizer | None = None,
                 retry: bool = False) -> None:
        self.loc, self.fs, self.model, self.tokenizer = loc, loc.fs, model, tokenizer
        self.path = loc.url  # type: ignore[assignment]
        self.parts = loc.path + ".parts"
        self.done, self.done_failed = set(), 0
        self._buffer = []
        if not resume:
            self._remove_parts()
        elif not self.fs.exists(self.parts) and self.fs.exists(loc.path):
            self.fs.copy(loc.path, f"{self.parts}/part-000000.jsonl")  # a completed output: its lines are done
        self._next = 0
        for part in self._part_files():
            self._read_back(part, retry)
            self._next = int(part.rsplit("-", 1)[1].split(".")[0]) + 1

    def _part_files(self) -> list[str]:
        return sorted(self.fs.glob(self.parts + "/part-*.jsonl"))

    def _remove_parts(self) -> None:
        if self.fs.exists(self.parts):
            self.fs.rm(self.parts, recursive=True)

    def _read_back(self, part: str, retry: bool) -> None:
        kept: list[bytes] = []
        dropped = False
        with self.fs.open(part, "rb") as f:
            for number, raw in enumerate(f, start=1):
                record = _parse(raw)
                if record is None:  # parts are written whole: this is not ours
                    raise BatchgenError(f"cannot resume: line {number} of {part} is not a batchgen output "
                                        "record; use --overwrite to start over")
                if retry and is_retryable(record):
                    dropped = True
                    continue
                kept.append(raw)
                self.done.add(record_key(record))
                self.done_failed += record_error(record) is not None
        if dropped:
            write_atomic(self.fs, part, b"".join(kept))

    def flush(self) -> None:
        if self._buffer:
            data = "".join(self._buffer).encode("utf-8")
            write_atomic(self.fs, f"{self.parts}/part-{self._next:06d}.jsonl", data)
            self._next += 1
            self._buffer.clear()

    def commit(self) -> None:
        """Stream the parts into the output (published whole when the write closes)."""
        self.flush()
        with self.fs.open(self.loc.path, "wb") as out:
            for part in self._part_files():
                with self.fs.open(part, "rb") as f:
                    while block := f.read(8 << 20):
                        out.write(block)
        self._remove_parts()

    def close(self) -> None:
        self.flush()


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
        record_key(record)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if isinstance(record, dict) else None
