"""`batchgen run` on a JSONL of OpenAI `/v1/images/generations` batch lines.

Input line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/images/generations",
     "body": {"prompt": "a red fox", "size": "256x256", "n": 2, "seed": 7,
              "num_inference_steps": 20, "guidance_scale": 4.5, "response_format": "url"}}

(DiT pipelines take "class_label" instead of "prompt"; a video pipeline, Wan, takes "num_frames"
too.) Every image is written as a PNG under `<output>.images/`; the result line is OpenAI's images
response (`{"created", "data": [{"url"} | {"b64_json"}]}`) under `response.body`, `url` being the
PNG's path (a video's: its MP4, or its frames' folder without the `video` extra, with
`frames_dir` beside it); a `.parquet` output has a row per line instead (images_sink.py). The job is a text job's (io/job.py, io/spec.py) with this
reader, sink and backend: per-line errors, custom_id rules, the input fingerprint of `--resume`
and the summary are theirs.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from typing import TYPE_CHECKING

from ...io.backend import Work
from ...io.job import JobSummary, run_reader
from ...io.spec import Formats, JobSpec
from ...progress import Mode
from ..engine.diffusion_engine import DiffusionEngine, ImageOutput
from ..engine.request import ImageRequest
from .images_lines import ImagesReader, LineResult
from .images_sink import ImagesJsonlSink, ImagesParquetSink

if TYPE_CHECKING:
    from ...io.dask_backend import DaskBackend

# PNGs are written beside the output, so an image job's files are local
IMAGE_FORMATS = Formats(inputs=(".jsonl",), outputs=(".jsonl", ".parquet"), job="an image job", datasets=False,
                        remote=False)


# a line's image requests and its response_format
ImageLine = tuple[list[ImageRequest], str]
# (image requests, the most in flight) -> (position in the requests, output) as each finishes
ImageStream = Callable[[Iterable[ImageRequest], int], Iterator[tuple[int, ImageOutput]]]


def engine_stream(engine: DiffusionEngine) -> ImageStream:
    """Images on one in-process engine."""
    return lambda requests, in_flight: ((out.index, out) for out in engine.stream(requests, in_flight))


def cluster_stream(backend: DaskBackend) -> ImageStream:
    """Images on a Dask cluster's engines (the cluster runtime: combined per worker, migrated)."""
    return lambda requests, in_flight: backend.run(((req, None) for req in requests), in_flight)


class DiffusionBackend:
    """A line's images join an image stream one by one, and the line comes back once the last of
    them has finished.

    max_images: the most images in flight at once, whatever the job's chunk size: an engine
    admits every waiting image in one go (a text-encoder batch over all of them)."""

    def __init__(self, images: ImageStream, *, max_images: int = 256) -> None:
        self.stream, self.max_images, self.images = images, max_images, 0

    def run(self, lines: Iterable[ImageLine], max_in_flight: int) -> Iterator[tuple[int, LineResult]]:
        owner: dict[int, tuple[int, int]] = {}  # stream position -> (line position, image number)
        parts: dict[int, list[ImageOutput | None]] = {}  # line position -> its images so far
        formats: dict[int, str] = {}  # line position -> its response_format
        stream_position = itertools.count()

        def images() -> Iterator[ImageRequest]:
            for position, (requests, response_format) in enumerate(lines):
                parts[position] = [None] * len(requests)
                formats[position] = response_format
                for i, req in enumerate(requests):
                    owner[next(stream_position)] = (position, i)
                    yield req

        for at, out in self.stream(images(), min(max_in_flight, self.max_images)):
            position, i = owner.pop(at)
            done = parts[position]
            done[i] = out
            if any(o is None for o in done):
                continue
            del parts[position]
            error = next((o.error for o in done if o.error), None)  # type: ignore[union-attr]
            if error is None and formats.pop(position) == "b64_json" and any(o.frames is not None for o in done):
                # a line without num_frames learns only now that this model makes videos
                error = "body.response_format: must be 'url' for a video (this model makes videos), got 'b64_json'"
            self.images += len(done) if error is None else 0
            yield position, LineResult([o.result for o in done] if error is None else [], error)  # type: ignore[union-attr]

    def progress_status(self) -> str:
        return f"{self.images} images"


# work item: an ImageRow's ImageRequests and response_format; amount: a LineResult's images
IMAGES = Work(attrgetter("images", "response_format"), lambda result: len(result.images), unit="images")


def run_images_job(spec: JobSpec, images: ImageStream, *, model_name: str, chunk_size: int = 256,
                   progress: Mode = "auto") -> JobSummary:
    """Run ``spec``'s image batch file (made with ``formats=IMAGE_FORMATS``) on ``images``
    (engine_stream or cluster_stream); call ``spec.check()`` first. model_name: the records'
    ``model`` field."""
    spec.prepare_output()
    sink = (ImagesParquetSink(spec.output, resume=spec.resume) if spec.output_format == "parquet"
            else ImagesJsonlSink(spec.output, model=model_name, resume=spec.resume))
    return run_reader(ImagesReader(spec.source), sink, DiffusionBackend(images), work=IMAGES,
                      chunk_size=chunk_size, progress=progress)
