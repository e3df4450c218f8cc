"""batchgen.diffuse: one pandas partition in, the same rows out plus `image_path` and `error`.

    ddf.map_partitions(batchgen.diffuse, model="path/to/pipeline", output_dir="out/images")

Each row is one ImageRequest: columns named like its fields (prompt or class_label, height,
width, num_inference_steps, guidance_scale, seed; missing column or NA: the keyword default).
PNG names are content hashes of (model, request), so a rerun or a retried partition rewrites
the same file. One engine per process (per Dask worker) and model, shared by its partitions.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..io.cells import is_na
from .request import ImageRequest

if TYPE_CHECKING:
    import pandas as pd

    from .engine import DiffusionEngine

FIELDS = ("prompt", "class_label", "height", "width", "num_inference_steps", "guidance_scale", "seed")
_ENGINES: dict[tuple, "DiffusionEngine"] = {}
_LOCK = threading.Lock()


def diffuse(pdf: pd.DataFrame, *, model: str | Path, output_dir: str | Path,
            engine_options: dict[str, Any] | None = None, **defaults: Any) -> pd.DataFrame:
    """Generate one image per row of `pdf`, write it to `output_dir` as PNG.

    Returns `pdf` (same index and order) plus `image_path` (str, NA on error) and `error` (NA, or
    the message naming the row, the field and the value). A bad row fails alone; a model that
    cannot load raises. defaults: ImageRequest fields for rows that do not give them."""
    import pandas as pd

    from ..cluster.frame import is_meta_call

    unknown = sorted(set(defaults) - set(FIELDS))
    if unknown:
        raise TypeError(f"diffuse() got unknown keyword {unknown[0]!r} (ImageRequest fields: {', '.join(FIELDS)})")
    out = pdf.copy()
    if len(pdf) == 0 or is_meta_call():
        out["image_path"] = pd.array([pd.NA] * len(pdf), dtype="string")
        out["error"] = pd.array([pd.NA] * len(pdf), dtype="string")
        return out
    engine = _engine(str(model), engine_options or {})
    reqs, errors = _requests(pdf, defaults)
    outdir = Path(output_dir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths: list[Any] = [pd.NA] * len(pdf)
    runnable = [i for i, r in enumerate(reqs) if r is not None]
    with _LOCK:  # one engine, many partitions on its worker's threads: they take turns
        results = engine.generate_outputs([reqs[i] for i in runnable])
    for i, res in zip(runnable, results):
        if res.error:
            errors[i] = f"row {pdf.index[i]!r}: {res.error}"
        else:
            p = outdir / f"{_name(engine.model_key, reqs[i])}.png"
            res.image.save(p, format="PNG")
            paths[i] = str(p)
    out["image_path"] = pd.array(paths, dtype="string")
    out["error"] = pd.array(errors, dtype="string")
    return out


def _engine(model: str, options: dict[str, Any]) -> DiffusionEngine:
    from .engine import DiffusionEngine

    key = (str(Path(model).resolve()), tuple(sorted(options.items())))
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = DiffusionEngine(model, **options)
    return engine


def _requests(pdf: pd.DataFrame, defaults: dict[str, Any]) -> tuple[list[ImageRequest | None], list[Any]]:
    import pandas as pd

    reqs: list[ImageRequest | None] = []
    errors: list[Any] = []
    for label, row in zip(pdf.index, pdf.to_dict("records")):
        kw = dict(defaults)
        for name in FIELDS:
            if name in row and not is_na(row[name]):
                kw[name] = _plain(name, row[name])
        try:
            reqs.append(ImageRequest(**kw))
            errors.append(pd.NA)
        except TypeError as exc:
            reqs.append(None)
            errors.append(f"row {label!r}: {exc}")
    return reqs, errors


INT_FIELDS = ("class_label", "height", "width", "num_inference_steps", "seed")


def _plain(name: str, value: Any) -> Any:
    # numpy scalars -> Python values; an int column with NA arrives as floats (3.0 -> 3)
    if hasattr(value, "item"):
        value = value.item()
    if name in INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _name(model_key: str, req: ImageRequest) -> str:
    return hashlib.sha1(repr((model_key, req)).encode()).hexdigest()[:20]
