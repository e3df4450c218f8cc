"""batchgen.diffuse: one pandas partition in, the same rows out plus `image_path`, `video_path`,
`frames_dir` and `error`.

    ddf.map_partitions(batchgen.diffuse, model="path/to/pipeline", output_dir="out/images")

Each row is one ImageRequest: columns named like its fields (prompt or class_label, height,
width, num_inference_steps, guidance_scale, seed, num_frames; missing column or NA: the keyword
default). On a video model (Wan) every row is a video: its frames go to a folder of PNGs and
an MP4 beside it (with the `video` extra).
PNG names are content hashes of (model, request), so a rerun or a retried partition rewrites
the same file. The rows join this worker's engine for the model (the cluster runtime's, as text
rows do: every partition on a worker is combined into its steps, and rows migrate between
workers and survive a lost worker).
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...cluster.frame import is_meta_partition
from ...cluster.generate import run_requests
from ...cluster.prestart import prestart
from ...io.cells import plain, whole_floats_to_int
from ..distributed.engine_spec import image_spec
from ..engine.request import ImageRequest
from .video_files import write_video

if TYPE_CHECKING:
    import pandas as pd

FIELDS = ("prompt", "class_label", "height", "width", "num_inference_steps", "guidance_scale", "seed", "num_frames")


def diffuse(pdf: pd.DataFrame, *, model: str | Path, output_dir: str | Path,
            engine_options: dict[str, Any] | None = None, partition_info: Mapping[str, Any] | None = None,
            **defaults: Any) -> pd.DataFrame:
    """Generate one image (or video) per row of `pdf`, write it to `output_dir` as PNG (a video as
    a folder of frame PNGs and an MP4).

    Returns `pdf` (same index and order) plus `image_path` (str, NA on error) and `error` (NA, or
    the message naming the row, the field and the value); a video's row (a video model: Wan) has
    `video_path` (its MP4, NA without the `video` extra) and `frames_dir` (its folder of frame
    PNGs) instead of image_path; both are NA on an image's row. A bad row fails alone; a model that
    cannot load raises. defaults: ImageRequest fields for rows that do not give them.
    partition_info: Dask's, for each real partition (its meta inference call gets none, and is
    answered without the model: cluster/frame.is_meta_partition)."""
    import pandas as pd

    unknown = sorted(set(defaults) - set(FIELDS))
    if unknown:
        raise TypeError(f"diffuse() got unknown keyword {unknown[0]!r} (ImageRequest fields: {', '.join(FIELDS)})")
    spec = image_spec(model, engine_options)
    out = pdf.copy()
    meta = is_meta_partition(pdf, partition_info)
    if meta:
        prestart(spec)  # graph construction on the client: workers load the pipeline now
    if len(pdf) == 0 or meta:
        for name in ("image_path", "video_path", "frames_dir", "error"):
            out[name] = pd.array([pd.NA] * len(pdf), dtype="string")
        return out
    reqs, errors = _requests(pdf, defaults)
    outdir = Path(output_dir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths: list[Any] = [pd.NA] * len(pdf)
    mp4s: list[Any] = [pd.NA] * len(pdf)
    dirs: list[Any] = [pd.NA] * len(pdf)
    runnable = [i for i, r in enumerate(reqs) if r is not None]
    results = run_requests(spec, [(reqs[i], None) for i in runnable])
    model_key = str(Path(spec.model).resolve())  # the engine's own key (DiffusionEngine.model_key)
    for i, res in zip(runnable, results):
        if res.error:
            errors[i] = f"row {pdf.index[i]!r}: {res.error}"
        elif res.frames is not None:
            try:
                files = write_video(outdir, _name(model_key, reqs[i]), res.frames)
            except Exception as exc:  # noqa: BLE001 - a codec or disk fault fails this row, not the partition
                errors[i] = f"row {pdf.index[i]!r}: writing the video failed: {type(exc).__name__}: {exc}"
                continue
            mp4s[i] = pd.NA if files.mp4 is None else str(files.mp4)
            dirs[i] = str(files.frames_dir)
        else:
            p = outdir / f"{_name(model_key, reqs[i])}.png"
            res.image.save(p, format="PNG")
            paths[i] = str(p)
    out["image_path"] = pd.array(paths, dtype="string")
    out["video_path"] = pd.array(mp4s, dtype="string")
    out["frames_dir"] = pd.array(dirs, dtype="string")
    out["error"] = pd.array(errors, dtype="string")
    return out


def _requests(pdf: pd.DataFrame, defaults: dict[str, Any]) -> tuple[list[ImageRequest | None], list[Any]]:
    import pandas as pd

    reqs: list[ImageRequest | None] = []
    errors: list[Any] = []
    for label, row in zip(pdf.index, pdf.to_dict("records")):
        kw = dict(defaults)
        cells = {name: plain(row[name]) for name in FIELDS if name in row}
        kw.update(whole_floats_to_int({k: v for k, v in cells.items() if v is not None}, INT_FIELDS))
        try:
            reqs.append(ImageRequest(**kw))
            errors.append(pd.NA)
        except TypeError as exc:
            reqs.append(None)
            errors.append(f"row {label!r}: {exc}")
    return reqs, errors


INT_FIELDS = ("class_label", "height", "width", "num_inference_steps", "seed", "num_frames")


def _name(model_key: str, req: ImageRequest) -> str:
    # an image request hashes as before num_frames existed: a rerun rewrites the same PNG
    text = repr((model_key, req))
    if req.num_frames is None:  # the last field: only the end of the text may lose it
        text = text.removesuffix(", num_frames=None))") + "))"
    return hashlib.sha1(text.encode()).hexdigest()[:20]
