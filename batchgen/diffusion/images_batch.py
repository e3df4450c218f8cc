"""`batchgen run` on a JSONL of OpenAI `/v1/images/generations` batch lines.

Input line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/images/generations",
     "body": {"prompt": "a red fox", "size": "256x256", "n": 2, "seed": 7,
              "num_inference_steps": 20, "guidance_scale": 4.5, "response_format": "url"}}

(DiT pipelines take "class_label" instead of "prompt".) Every image is written as a PNG under
`<output>.images/`; the result line is OpenAI's images response (`{"created", "data": [{"url"} |
{"b64_json"}]}`) under `response.body`, `url` being the PNG's path. Per-line errors, custom_id
rules and `--resume` are those of the text batch format (io/openai_batch.py, io/jsonl_sink.py).
"""
from __future__ import annotations

import base64
import hashlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io.jsonl_sink import JsonlSink
from ..io.openai_batch import _record, identify
from ..io.request import NO_VALUE, Request, RowError
from .engine import DiffusionEngine, ImageOutput
from .request import ImageRequest

URL = "/v1/images/generations"
BODY_FIELDS = {"prompt", "class_label", "size", "n", "seed", "num_inference_steps", "guidance_scale",
               "response_format", "model"}
MAX_N = 10
_SIZE = re.compile(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*", re.ASCII)


@dataclass
class Line:
    req: Request
    images: list[ImageRequest] = field(default_factory=list)
    response_format: str = "url"
    done: dict[int, ImageOutput] = field(default_factory=dict)


def parse_line(req: Request, obj: dict[str, Any]) -> Line:
    line = Line(req)
    if not req.is_valid:
        return line
    method, url, body = obj.get("method", NO_VALUE), obj.get("url", NO_VALUE), obj.get("body")
    if method != "POST":
        req.fail("invalid_method", "must be 'POST'", "method", None if method is NO_VALUE else method)
    elif url != URL:
        req.fail("invalid_url", f"must be {URL!r}", "url", None if url is NO_VALUE else url)
    elif not isinstance(body, dict):
        req.fail("invalid_body", "must be a JSON object", "body", body)
    else:
        _parse_body(line, body)
    return line


def _parse_body(line: Line, body: dict[str, Any]) -> None:
    req = line.req
    unknown = sorted(set(body) - BODY_FIELDS)
    if unknown:
        req.fail("unknown_parameter", "not a field of this endpoint", "body." + unknown[0])
        return
    size = body.get("size")
    height = width = None
    if size is not None:
        match = _SIZE.fullmatch(size) if isinstance(size, str) else None
        if match is None:
            req.fail("invalid_size", "must be 'WIDTHxHEIGHT'", "body.size", size)
            return
        width, height = int(match[1]), int(match[2])
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        req.fail("invalid_n", f"must be an integer in 1..{MAX_N}", "body.n", n)
        return
    fmt = body.get("response_format", "url")
    if fmt not in ("url", "b64_json"):
        req.fail("invalid_response_format", "must be 'url' or 'b64_json'", "body.response_format", fmt)
        return
    line.response_format = fmt
    seed = body.get("seed", 0)
    kw = {k: body[k] for k in ("prompt", "class_label", "num_inference_steps", "guidance_scale") if k in body}
    counted = isinstance(seed, int) and not isinstance(seed, bool)  # otherwise ImageRequest names it
    for i in range(n):
        line.images.append(ImageRequest(height=height, width=width, seed=seed + i if counted else seed, **kw))


class ImagesSink(JsonlSink):
    """The text format's resumable JSONL writer with images responses."""

    def add_images(self, line: Line, paths: list[Path]) -> None:
        data = []
        for p in paths:
            item: dict[str, Any] = {"url": str(p), "revised_prompt": None}
            if line.response_format == "b64_json":
                item = {"b64_json": base64.b64encode(p.read_bytes()).decode("ascii"), "revised_prompt": None}
            data.append(item)
        self._add(_record(line.req, 200, {"created": int(time.time()), "data": data}))


def read_lines(path: Path, skip: set) -> Iterator[Line]:
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            req, obj = identify(raw, number, seen)
            if req.key in skip:
                continue
            yield parse_line(req, obj)


def run_images_file(engine: DiffusionEngine, input_path: Path, output_path: Path, *, resume: bool = False) -> dict[str, int]:
    """Run every line; -> {"lines", "succeeded", "errors", "images"} of this run."""
    image_dir = output_path.with_name(output_path.name + ".images")
    image_dir.mkdir(parents=True, exist_ok=True)
    sink = ImagesSink(output_path, model=engine.pipe.path.name, resume=resume)
    counts = {"lines": 0, "succeeded": 0, "errors": 0, "images": 0}
    owner: list[tuple[Line, int]] = []  # engine stream position -> (line, image number)

    def feed() -> Iterator[ImageRequest]:
        for line in read_lines(input_path, sink.done):
            counts["lines"] += 1
            if not line.req.is_valid:
                sink.add_error(line.req)
                counts["errors"] += 1
                continue
            for i, image in enumerate(line.images):
                owner.append((line, i))
                yield image

    try:
        for out in engine.stream(feed()):
            line, i = owner[out.index]
            line.done[i] = out
            if len(line.done) < len(line.images):
                continue
            failed = [o for o in line.done.values() if o.error]
            if failed:
                line.req.fail_with(RowError("invalid_request", failed[0].error))
                sink.add_error(line.req)
                counts["errors"] += 1
            else:
                paths = []
                for j in range(len(line.images)):
                    p = image_dir / f"{_safe(line.req)}_{j}.png"
                    line.done[j].image.save(p, format="PNG")
                    paths.append(p)
                sink.add_images(line, paths)
                counts["succeeded"] += 1
                counts["images"] += len(paths)
            sink.flush()
            line.done.clear()
    except BaseException:
        sink.close()
        raise
    sink.commit()
    return counts


def _safe(req: Request) -> str:
    """A file name for the line's PNGs; a custom_id changed by the cleaning (or cut) gets a hash
    of itself, so ids like "a b" and "a_b" never share a file."""
    key = req.custom_id if req.custom_id is not None else f"line{req.number}"
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in key)[:100]
    if safe != key:
        safe += "-" + hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return safe


def run_cli(args: Any) -> int:
    """`batchgen run --model PIPELINE_DIR --input images.jsonl --output out.jsonl [--resume]`."""
    import sys

    from ..errors import BatchgenError

    inp, out = Path(args.input), Path(args.output)
    if inp.suffix != ".jsonl" or out.suffix != ".jsonl":
        raise BatchgenError("image generation reads and writes OpenAI batch .jsonl files")
    if not inp.is_file():
        raise BatchgenError(f"--input {inp}: no such file")
    if out.exists() and not (args.resume or args.overwrite):
        raise BatchgenError(f"--output {out} exists: pass --resume to continue it or --overwrite to replace it")
    engine = DiffusionEngine(args.model, dtype=getattr(args, "dtype", None) or "auto",
                             device=getattr(args, "device", None),
                             max_image_tokens=getattr(args, "max_image_tokens", None))
    start = time.monotonic()
    counts = run_images_file(engine, inp, out, resume=bool(args.resume))
    print(f"batchgen: wrote {out}: {counts['lines']} lines: {counts['succeeded']} succeeded, {counts['errors']} errors; "
          f"{counts['images']} images in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0
