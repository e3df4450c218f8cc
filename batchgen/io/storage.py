"""Where a file job's data lives: every path ``batchgen run`` takes, through fsspec.

A location is a local path, ``file://``, ``s3://``, ``gs://``, ``abfs://``, ``memory://`` or (for
input) ``http(s)://``, with storage options from ``--storage-option key=value`` over
``dask.config`` ``batchgen.storage-options`` (credentials come from each filesystem's usual
environment). An input may be a glob or a directory: its files in name order, Parquet datasets
with hive partitions included. A filesystem library that is not installed is named by the
extra that installs it. See docs/guides/file-jobs.md.
"""
from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import dask.config
from fsspec.core import url_to_fs
from fsspec.utils import infer_compression

from batchgen.errors import BatchgenError

# protocol -> the pyproject extra whose library implements it
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "abfs": "azure", "abfss": "azure", "az": "azure",
          "http": "http", "https": "http"}
COMPRESSION_EXTRAS = {"zstd": "zstd"}
LOCAL = ("file", "local")


def storage_options(given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``dask.config`` ``batchgen.storage-options`` overlaid with ``given`` (the CLI's)."""
    base = dask.config.get("batchgen.storage-options", default=None) or {}
    return {**dict(base), **dict(given or {})}


def parse_storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["anon=true", "client_kwargs.endpoint_url=http://x"]`` -> fsspec storage options; values
    are read as YAML scalars (true, 3, 1.5) and dotted keys make nested mappings."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise BatchgenError(f"--storage-option {pair!r}: expected KEY=VALUE")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out
        *parents, leaf = key.strip().split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    return out


@dataclass(frozen=True, slots=True)
class Location:
    """One URL on its filesystem: ``fs`` and the filesystem's own ``path`` for it."""

    url: str
    fs: Any = field(repr=False)
    path: str

    @property
    def is_local(self) -> bool:
        return _protocol(self.fs) in LOCAL

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    def child(self, name: str) -> Location:
        return Location(self.url.rstrip("/") + "/" + name, self.fs, self.path.rstrip("/") + "/" + name)

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.path))

    def local_path(self) -> Path:
        """The path on this machine (local locations only)."""
        return Path(self.path)


def locate(url: str | Path, options: Mapping[str, Any] | None = None, *, flag: str = "--input") -> Location:
    """``url`` on its filesystem; a missing filesystem library raises naming its extra."""
    text = str(url)
    try:
        fs, path = url_to_fs(text, **storage_options(options))
    except ImportError as exc:
        protocol = text.split("://", 1)[0] if "://" in text else "file"
        extra = EXTRAS.get(protocol)
        hint = f": pip install 'batchgen[{extra}]'" if extra else ""
        raise BatchgenError(f"{flag} {text}: the {protocol}:// filesystem is not installed ({exc}){hint}") from None
    except (ValueError, TypeError) as exc:
        raise BatchgenError(f"{flag} {text}: {exc}") from None
    if _protocol(fs) in LOCAL:
        path = str(Path(path).expanduser())
    return Location(text, fs, path)


def _protocol(fs: Any) -> str:
    protocol = fs.protocol
    return protocol[0] if isinstance(protocol, (tuple, list)) else protocol


def describe_failure(flag: str, url: str, exc: BaseException) -> BatchgenError:
    """One line for a storage failure: a missing object or bucket, denied access, no credentials."""
    kind = type(exc).__name__
    text = str(exc) or kind
    if isinstance(exc, FileNotFoundError):
        return BatchgenError(f"{flag} {url}: no such file or bucket ({text})")
    if isinstance(exc, PermissionError):
        return BatchgenError(f"{flag} {url}: access denied ({text}); check the credentials "
                             "(the filesystem's usual environment, or --storage-option)")
    if "credential" in text.lower() or "NoCredentials" in kind:
        return BatchgenError(f"{flag} {url}: no credentials found ({text}); set them in the filesystem's "
                             "usual environment or pass --storage-option")
    return BatchgenError(f"{flag} {url}: cannot read it ({kind}: {text})")


def input_files(loc: Location, suffixes: Sequence[str], *, flag: str = "--input") -> list[str]:
    """The files an input names, in name order: itself, the matches of a glob, or every file
    under a directory whose name ends with one of ``suffixes`` (hidden and ``_`` files skipped,
    as Dask and Arrow skip them)."""
    try:
        if _has_magic(loc.path):
            found = sorted(p for p in loc.fs.glob(loc.path) if not loc.fs.isdir(p))
        elif loc.fs.isdir(loc.path):
            found = sorted(p for p in loc.fs.find(loc.path) if _is_data(p, loc.path, suffixes))
        else:
            loc.fs.info(loc.path)  # FileNotFoundError for a missing object or bucket
            return [loc.path]
    except BatchgenError:
        raise
    except Exception as exc:  # noqa: BLE001 - each filesystem raises its own: one message, exit 2
        raise describe_failure(flag, loc.url, exc) from None
    if not found:
        raise BatchgenError(f"{flag} {loc.url}: matches no {' or '.join(suffixes)} file")
    return found


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def _is_data(path: str, root: str, suffixes: Sequence[str]) -> bool:
    parts = path[len(root.rstrip("/")):].strip("/").split("/")
    if any(p.startswith((".", "_")) for p in parts):
        return False
    return any(path.lower().endswith(s) for s in suffixes)


def compression_of(path: str) -> str | None:
    """fsspec's codec for a name (``.gz``, ``.bz2``, ``.zst``, ``.xz``), or None."""
    return infer_compression(path)


def open_input(fs: Any, path: str, url: str, flag: str = "--input") -> IO[bytes]:
    """``path`` opened for reading, decompressed by its name; a codec whose library is missing
    raises naming its extra."""
    codec = compression_of(path)
    try:
        raw = fs.open(path, "rb")
    except Exception as exc:  # noqa: BLE001
        raise describe_failure(flag, url, exc) from None
    if codec is None:
        return raw
    try:
        from fsspec.compression import compr

        return compr[codec](raw, mode="rb")
    except (ImportError, KeyError) as exc:
        raw.close()
        extra = COMPRESSION_EXTRAS.get(codec)
        hint = f": pip install 'batchgen[{extra}]'" if extra else ""
        raise BatchgenError(f"{flag} {url}: reading {codec} needs its library ({exc}){hint}") from None


def strip_compression(name: str) -> str:
    """``in.jsonl.gz`` -> ``in.jsonl``: the format is the name before its codec suffix."""
    if compression_of(name) is not None:
        return name.rsplit(".", 1)[0]
    return name


def write_atomic(fs: Any, path: str, data: bytes) -> None:
    """A whole object or file, never half: object stores publish a PUT at once; a local file is
    written under a temporary name, synced and renamed into place."""
    if _protocol(fs) not in LOCAL:
        with fs.open(path, "wb") as f:
            f.write(data)
        return
    import os

    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
