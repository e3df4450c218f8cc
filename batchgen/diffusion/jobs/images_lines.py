"""One line of an image batch file: parsed into the ImageRequests it asks for (one per image of
``body.n``), and what comes back for it once all of them have finished.

The custom_id rules, per-line errors and keys are those of the text format (io/openai_batch.py);
images_batch.py has the format, images_sink.py writes the results.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...io.openai_batch import count_lines, read_lines
from ...io.request import NO_VALUE, Request, RowKey
from ...io.source import Source
from ..engine.request import ImageRequest

URL = "/v1/images/generations"
BODY_FIELDS = {"prompt", "class_label", "size", "n", "seed", "num_inference_steps", "guidance_scale",
               "response_format", "model", "num_frames"}  # num_frames: a video (diffusers' name)
MAX_N = 10
_SIZE = re.compile(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*", re.ASCII)


@dataclass(slots=True)
class ImageRow(Request):
    """A line of the input: a Request (key, where, error) with the images it asks for."""

    images: list[ImageRequest] = field(default_factory=list)
    response_format: str = "url"


@dataclass(slots=True)
class LineResult:
    """A line's images (PIL, in the line's order; a video: its list of frames) once all have
    finished, or the first error."""

    images: list[Any]
    error: str | None = None

    @property
    def finish_reason(self) -> str:
        return "error" if self.error is not None else "stop"


class ImagesReader:
    """The lines of ``path`` as ImageRows, parsed lazily."""

    def __init__(self, path: Source | Path) -> None:
        self.path = path

    def count(self) -> int:
        return count_lines(self.path)

    def requests(self, skip: set[RowKey] | frozenset[RowKey] = frozenset()) -> Iterator[ImageRow]:
        for row, obj in read_lines(self.path, skip, ImageRow):
            yield parse_line(row, obj)


def parse_line(row: ImageRow, obj: dict[str, Any]) -> ImageRow:
    if not row.is_valid:
        return row
    method, url, body = obj.get("method", NO_VALUE), obj.get("url", NO_VALUE), obj.get("body")
    if method != "POST":
        row.fail("invalid_method", "must be 'POST'", "method", None if method is NO_VALUE else method)
    elif url != URL:
        row.fail("invalid_url", f"must be {URL!r}", "url", None if url is NO_VALUE else url)
    elif not isinstance(body, dict):
        row.fail("invalid_body", "must be a JSON object", "body", body)
    else:
        _parse_body(row, body)
    return row


def _parse_body(row: ImageRow, body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        row.fail("unknown_parameter", "not a field of this endpoint", "body." + unknown[0])
        return
    size = body.get("size")
    height = width = None
    if size is not None:
        match = _SIZE.fullmatch(size) if isinstance(size, str) else None
        if match is None:
            row.fail("invalid_size", "must be 'WIDTHxHEIGHT'", "body.size", size)
            return
        width, height = int(match[1]), int(match[2])
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        row.fail("invalid_n", f"must be an integer in 1..{MAX_N}", "body.n", n)
        return
    fmt = body.get("response_format", "url")
    if fmt not in ("url", "b64_json"):
        row.fail("invalid_response_format", "must be 'url' or 'b64_json'", "body.response_format", fmt)
        return
    if fmt == "b64_json" and body.get("num_frames") is not None:
        row.fail("invalid_response_format", "must be 'url' for a video (body.num_frames)", "body.response_format", fmt)
        return
    row.response_format = fmt
    seed = body.get("seed", 0)
    kw = {k: body[k] for k in ("prompt", "class_label", "num_inference_steps", "guidance_scale", "num_frames")
          if k in body}
    counted = isinstance(seed, int) and not isinstance(seed, bool)  # otherwise ImageRequest names it
    for i in range(n):
        row.images.append(ImageRequest(height=height, width=width, seed=seed + i if counted else seed, **kw))
