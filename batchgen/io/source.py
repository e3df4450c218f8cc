"""A job's input: the files one ``--input`` names, their format, and their digest.

JSONL parts are read in name order as one file (line numbers run on across parts, so every
line keeps one key); Parquet files, a directory of them or a hive-partitioned dataset are read
through ``pyarrow.dataset``. The digest covers every byte of every file as stored (compressed
or not), streamed, so ``--resume`` notices an edit anywhere in the input.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from batchgen.errors import BatchgenError
from batchgen.io.storage import Location, describe_failure, input_files, locate, open_input, strip_compression

Format = Literal["jsonl", "parquet"]
SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".parquet": "parquet"}
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.bz2", ".jsonl.zst", ".jsonl.xz")
_BLOCK = 8 << 20


def format_of_name(name: str) -> Format | None:
    """The format a file name (or glob) says, its compression suffix aside."""
    base = strip_compression(name.rstrip("/")).lower()
    return next((f for s, f in SUFFIXES.items() if base.endswith(s)), None)


@dataclass(frozen=True, slots=True)
class Source:
    """The files of one input, in reading order, on one filesystem."""

    loc: Location
    files: tuple[str, ...]
    format: Format

    @classmethod
    def open(cls, url: str | Path, options: Mapping[str, Any] | None = None,
             formats: tuple[str, ...] = tuple(SUFFIXES)) -> Source:
        """Resolve ``url``; ``BatchgenError`` (exit 2) for a missing filesystem library, object,
        bucket or credentials, or a format the job does not read."""
        loc = locate(url, options)
        named = format_of_name(loc.path)
        if named is None and not any(c in loc.path for c in "*?[") and not _is_dir(loc):
            raise BatchgenError(f"--input {url}: reads {' or '.join(formats)} files (optionally compressed: .gz, "
                                f".bz2, .zst, .xz), a glob or a directory of them; its extension is "
                                f"{Path(loc.path).suffix!r}")
        if named is not None or not _is_dir(loc):
            suffixes = JSONL_SUFFIXES if named == "jsonl" else (".parquet",)
            files = input_files(loc, suffixes)
            fmt = named or format_of_name(files[0])
        else:  # a directory: a Parquet dataset, or JSONL parts
            try:
                files = input_files(loc, (".parquet",))
                fmt = "parquet"
            except BatchgenError:
                files = input_files(loc, JSONL_SUFFIXES)
                fmt = "jsonl"
        if fmt is None or f".{fmt}" not in formats:
            raise BatchgenError(f"--input {url}: reads {' or '.join(formats)} (optionally compressed: .gz, .bz2, "
                                ".zst, .xz), a glob of them or a directory of them; got {loc.name!r}")
        return cls(loc, tuple(files), fmt)

    @property
    def is_dataset(self) -> bool:
        return len(self.files) > 1 or self.files[0] != self.loc.path

    def stream(self, path: str) -> IO[bytes]:
        return open_input(self.loc.fs, path, self.loc.url)

    def lines(self) -> Iterator[bytes]:
        """Every line of every part, in order (the last line of a part always ends one)."""
        for path in self.files:
            with self.stream(path) as f:
                for raw in f:
                    yield raw if raw.endswith(b"\n") else raw + b"\n"

    def check_readable(self) -> None:
        """Read the first byte of the first file: fails in seconds on a denied or broken object."""
        try:
            with self.stream(self.files[0]) as f:
                f.read(1)
        except BatchgenError:
            raise
        except Exception as exc:  # noqa: BLE001 - each filesystem's own errors: one message, exit 2
            raise describe_failure("--input", self.loc.url, exc) from None

    def digest(self) -> dict[str, Any]:
        """sha256 of every file's stored bytes (and names, relative to the input), streamed."""
        total, h = 0, hashlib.sha256()
        root = self.loc.path.rstrip("/")
        for path in self.files:
            h.update(path.removeprefix(root).encode("utf-8", "surrogatepass") + b"\0")
            with self.loc.fs.open(path, "rb") as f:
                while block := f.read(_BLOCK):
                    h.update(block)
                    total += len(block)
        return {"files": len(self.files), "bytes": total, "sha256": h.hexdigest()}

    def same_as(self, other: Location) -> bool:
        """Whether ``other`` is this input or one of its files (an output must not be)."""
        return other.fs.protocol == self.loc.fs.protocol and (
            other.path.rstrip("/") == self.loc.path.rstrip("/") or other.path in self.files)

    def arrow_dataset(self) -> Any:
        """The Parquet files as one ``pyarrow.dataset`` (hive partition columns included)."""
        import pyarrow.dataset as ds

        kwargs: dict[str, Any] = {"format": "parquet", "filesystem": self.loc.fs}
        if self.is_dataset and self.loc.is_dir():
            kwargs.update(partitioning="hive", partition_base_dir=self.loc.path.rstrip("/"))
        try:
            return ds.dataset(list(self.files), **kwargs)
        except Exception as exc:  # noqa: BLE001 - pyarrow's and the filesystem's errors: exit 2
            raise BatchgenError(f"cannot read {self.loc.url} as Parquet: {exc}") from None


def _is_dir(loc: Location) -> bool:
    try:
        return loc.is_dir()
    except Exception as exc:  # noqa: BLE001 - each filesystem's own errors: one message, exit 2
        raise describe_failure("--input", loc.url, exc) from None
