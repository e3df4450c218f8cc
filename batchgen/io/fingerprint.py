"""Which input an output was made from: a small sidecar (`<output>.input.json`) so that
`--resume` refuses to finish an output with rows of another file."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from batchgen.errors import BatchgenError

_EDGE = 1 << 20  # hash the first and last MiB: cheap on huge inputs, catches edited files


def sidecar(output: Path) -> Path:
    return output.with_name(output.name + ".input.json")


def fingerprint(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(_EDGE, size - _EDGE))
            digest.update(f.read(_EDGE))
    return {"input": str(path.resolve()), "size": size, "sha256_edges": digest.hexdigest()}


def record(input_path: Path, output: Path) -> None:
    sidecar(output).write_text(json.dumps(fingerprint(input_path), indent=1) + "\n")


def check_resume(input_path: Path, output: Path) -> None:
    """Raise when the output was started from a different input (by content, not by name)."""
    path = sidecar(output)
    if not path.is_file():
        return  # an output from before fingerprints, or written by hand: trust the user
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    now = fingerprint(input_path)
    if (kept.get("size"), kept.get("sha256_edges")) != (now["size"], now["sha256_edges"]):
        raise BatchgenError(f"--resume: {output} was started from another input ({kept.get('input')}, "
                            f"{kept.get('size')} bytes); {input_path} differs. Use --overwrite to start over "
                            f"or point --output elsewhere")
