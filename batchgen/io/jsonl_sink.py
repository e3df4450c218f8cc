"""Resumable OpenAI batch JSONL output: append, flush and fsync per batch of finished lines.

A SIGKILL can leave at most a torn last line (writes only ever append); ``--resume`` cuts it off
and reads the keys of every complete line as done.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.errors import BatchgenError
from batchgen.io.openai_batch import error_record, record_key, success_record
from batchgen.io.request import Request, RowKey

if TYPE_CHECKING:
    from batchgen.outputs import RequestOutput
    from batchgen.tokenizer import Tokenizer


class JsonlSink:
    flush_rows = 32

    def __init__(self, path: Path, *, model: str, resume: bool,
                 tokenizer: Tokenizer | None = None) -> None:
        self.path, self.model, self.tokenizer = path, model, tokenizer
        self.done: set[RowKey] = recover(path) if resume and path.exists() else set()
        self._buffer: list[str] = []
        self._file = open(path, "ab" if resume else "wb")

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
    done: set[RowKey] = set()
    good_end = 0
    with open(path, "r+b") as f:
        for number, raw in enumerate(f, start=1):
            record = _parse(raw) if raw.endswith(b"\n") else None
            if record is None:
                if f.read(1):  # not the last line: not a torn write, so not ours to cut
                    raise BatchgenError(f"cannot resume: line {number} of {path} is not a "
                                        "batchgen output record; use --overwrite to start over")
                break
            done.add(record_key(record))
            good_end += len(raw)
        f.truncate(good_end)
    return done


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
        record_key(record)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if isinstance(record, dict) else None
