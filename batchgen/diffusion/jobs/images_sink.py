"""Where an image job's results go: PNGs under ``<output>.images/``, and a record per line in the
text format's resumable JSONL or Parquet output (io/jsonl_sink.py, io/parquet_sink.py).

A line's PNGs are written before its record, so a record never names a missing file. Parquet
rows carry the JSONL records' fields as columns, each image as its PNG's path (a b64_json line
too: Parquet references images, never embeds them). A video is a folder of frame PNGs and an MP4
beside it (video_files.py); its path is the MP4's, or the folder's without the `video` extra.
"""
from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa

from ...io.jsonl_sink import JsonlSink
from ...io.openai_batch import response_record, row_key
from ...io.parquet_sink import ParquetSink
from ...io.request import Request, RowKey
from .images_lines import ImageRow, LineResult
from .video_files import write_video

IMAGE_COLUMNS = pa.schema([
    ("custom_id", pa.string()), ("line", pa.int64()), ("status_code", pa.int64()),
    ("images", pa.list_(pa.string())),  # the PNGs' paths (a video's MP4 or frames folder)
    ("error", pa.string()), ("error_code", pa.string()), ("error_param", pa.string()),
])


def image_dir(output: Path) -> Path:
    return output.with_name(output.name + ".images")


def save_pngs(output: Path, row: ImageRow, result: LineResult) -> list[tuple[Path, Path | None]]:
    """-> per image (its PNG, None); per video (its MP4 or frames folder, the frames folder)."""
    folder = image_dir(output)
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[tuple[Path, Path | None]] = []
    for j, image in enumerate(result.images):
        stem = f"{png_stem(row)}_{j}"
        if isinstance(image, list):
            files = write_video(folder, stem, image)
            paths.append((files.main, files.frames_dir))
        else:
            image.save(folder / f"{stem}.png", format="PNG")
            paths.append((folder / f"{stem}.png", None))
    return paths


def png_stem(row: ImageRow) -> str:
    """A file name for the line's PNGs; a custom_id changed by the cleaning (or cut) gets a hash
    of itself, so ids like "a b" and "a_b" never share a file."""
    key = row.custom_id if row.custom_id is not None else f"line{row.number}"
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in key)[:100]
    if safe != key:
        safe += "-" + hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return safe


class ImagesJsonlSink(JsonlSink):
    """The text format's JSONL writer with OpenAI images responses (``{"created", "data"}``)."""

    def add_result(self, req: ImageRow, out: LineResult) -> None:  # type: ignore[override]
        data = []
        for p, frames_dir in save_pngs(self.path, req, out):
            item: dict[str, Any] = {"url": str(p), "revised_prompt": None}
            if frames_dir is not None:
                item["frames_dir"] = str(frames_dir)
            elif req.response_format == "b64_json":
                item = {"b64_json": base64.b64encode(p.read_bytes()).decode("ascii"), "revised_prompt": None}
            data.append(item)
        self.add_record(response_record(req, 200, {"created": int(time.time()), "data": data}))


class ImagesParquetSink(ParquetSink):
    """One row per line, in input line order; resumes by the JSONL records' keys."""

    key_columns = ("custom_id", "error_code", "line")

    def __init__(self, path: Path, *, resume: bool) -> None:
        super().__init__(Path(path), pa.schema([]), resume=resume, columns=IMAGE_COLUMNS)

    def add_result(self, req: ImageRow, out: LineResult) -> None:  # type: ignore[override]
        paths = [str(p) for p, _ in save_pngs(self.path, req, out)]
        self.add_row(req, {"custom_id": req.custom_id, "line": req.number, "status_code": 200, "images": paths})

    def add_error(self, req: Request) -> None:
        assert req.error is not None
        self.add_row(req, {"custom_id": req.custom_id, "line": req.number, "status_code": 400, "images": None,
                           "error": req.error.message, "error_code": req.error.code,
                           "error_param": req.error.param})

    def keys(self, table: pa.Table) -> Iterable[RowKey]:
        return [row_key(*row) for row in zip(*(table[c].to_pylist() for c in self.key_columns))]

    def row_numbers(self, table: pa.Table) -> pa.Array:
        return table["line"].combine_chunks()

