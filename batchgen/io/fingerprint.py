"""What decides a job's outputs, recorded beside them so that ``--resume`` cannot mix two jobs.

The sidecar (``<output>.input.json``; inside a dataset output, ``_batchgen_job.json``) holds the
whole input's digest (every byte, streamed: io/source.py), the model's identity (digests of its
JSON files -- config, generation config, tokenizer, weight index -- and of each safetensors
file's header and size; whole files up to ``_WHOLE_FILE`` bytes), the options that change tokens
(sampling defaults, dtype, the Parquet column options) and batchgen's version. ``--resume``
compares them all and refuses naming each difference, unless ``--force-resume``.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchgen.errors import BatchgenError
from batchgen.io.storage import Location, write_atomic

_WHOLE_FILE = 64 << 20  # weights files up to this size are hashed whole (tiny and test models)
_BLOCK = 8 << 20


def sidecar(output: Location, dataset: bool) -> str:
    return output.path.rstrip("/") + ("/_batchgen_job.json" if dataset else ".input.json")


def _file_digest(path: Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK if limit is None else min(_BLOCK, limit)):
            h.update(block)
            if limit is not None:
                limit -= len(block)
                if limit <= 0:
                    break
    return h.hexdigest()


def _safetensors_digest(path: Path) -> str:
    """The header (names, dtypes, shapes, offsets) and size; the whole file when it is small."""
    size = path.stat().st_size
    if size <= _WHOLE_FILE:
        return _file_digest(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = f.read(min(length, 100 << 20))
    return hashlib.sha256(header + str(size).encode()).hexdigest()


def model_identity(model: str | Path) -> dict[str, Any]:
    """The model's identity: a local directory's file digests, or a hub id as given."""
    root = Path(model).expanduser()
    if not root.is_dir():
        return {"id": str(model)}
    files: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if len(path.relative_to(root).parts) > 3 or not path.is_file() or rel.startswith("."):
            continue
        if path.suffix == ".json":
            files[rel] = _file_digest(path)
        elif path.suffix == ".safetensors":
            files[rel] = _safetensors_digest(path)
    return {"path": str(root.resolve()), "files": files}


def job_record(input_digest: Mapping[str, Any], input_url: str, models: Mapping[str, Any],
               options: Mapping[str, Any]) -> dict[str, Any]:
    from batchgen import __version__

    return {"batchgen_version": __version__, "input": {"url": input_url, **input_digest},
            "models": dict(models), "options": json.loads(json.dumps(dict(options), default=str))}


def record(output: Location, dataset: bool, job: Mapping[str, Any]) -> None:
    write_atomic(output.fs, sidecar(output, dataset), (json.dumps(job, indent=1) + "\n").encode())


def read_record(output: Location, dataset: bool) -> dict[str, Any] | None:
    path = sidecar(output, dataset)
    try:
        with output.fs.open(path, "rb") as f:
            kept = json.loads(f.read())
    except (OSError, ValueError):
        return None  # an output from before fingerprints, or written by hand: trust the user
    return kept if isinstance(kept, dict) else None


def differences(kept: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Each thing that changed, named, e.g. ``options.temperature: 0.0 -> 0.7``."""
    out: list[str] = []
    if "batchgen_version" not in kept:  # an older batchgen's sidecar: the input's edges only
        if (kept.get("size"), kept.get("sha256_edges")) != (None, None):
            out.append(f"batchgen version: recorded by an older batchgen -> {now['batchgen_version']}")
        return out
    if kept["batchgen_version"] != now["batchgen_version"]:
        out.append(f"batchgen version: {kept['batchgen_version']} -> {now['batchgen_version']}")
    k_in, n_in = kept.get("input", {}), now["input"]
    if (k_in.get("sha256"), k_in.get("bytes")) != (n_in["sha256"], n_in["bytes"]):
        out.append(f"input: started from another input ({k_in.get('url')}, {k_in.get('bytes')} bytes, sha256 "
                   f"{str(k_in.get('sha256'))[:12]}); {n_in['url']} has {n_in['bytes']} bytes, sha256 "
                   f"{n_in['sha256'][:12]}")
    k_models, n_models = kept.get("models", {}), now["models"]
    for name in sorted(set(k_models) | set(n_models)):
        a, b = k_models.get(name), n_models.get(name)
        if a != b:
            out.append(f"model {name}: {_model_change(a, b)}")
    k_opt, n_opt = kept.get("options", {}), now["options"]
    for name in sorted(set(k_opt) | set(n_opt)):
        if k_opt.get(name) != n_opt.get(name):
            out.append(f"options.{name}: {k_opt.get(name)!r} -> {n_opt.get(name)!r}")
    return out


def _model_change(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> str:
    if a is None or b is None:
        return "added" if a is None else "removed"
    where = a.get("path", a.get("id")), b.get("path", b.get("id"))
    files_a, files_b = a.get("files", {}), b.get("files", {})
    changed = sorted(n for n in set(files_a) | set(files_b) if files_a.get(n) != files_b.get(n))
    what = f"files changed: {', '.join(changed[:5])}" + (" ..." if len(changed) > 5 else "") if changed else \
        "another model"
    return f"{what} (was {where[0]}, now {where[1]})"


def check_resume(output: Location, dataset: bool, now: Mapping[str, Any], force: bool) -> list[str]:
    """Raise when ``output`` was started by another job, naming every difference; with
    ``force``, return them (for a warning) instead."""
    kept = read_record(output, dataset)
    if kept is None:
        return []
    changed = differences(kept, now)
    if changed and not force:
        lines = "\n  ".join(changed)
        raise BatchgenError(f"--resume: {output.url} was started by another job; what changed:\n  {lines}\n"
                            "Use --overwrite to start over, point --output elsewhere, or pass --force-resume "
                            "to finish it anyway (mixing the two jobs' rows)")
    return changed
