"""ImageOutput: a finished image request; ImageResult: one as the elastic driver returns it."""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ImageOutput:
    """A finished request: image (PIL), or a video's frames (PIL, in order), or error (a message
    naming the field and the value)."""

    index: int
    image: Any = None
    array: Any = None        # [H, W, 3] float32 in [0, 1], before quantisation (a video's [F, H, W, 3])
    frames: list[Any] | None = None  # a video's frames; image is None then
    error: str | None = None
    steps: int = 0

    @property
    def result(self) -> Any:
        """What generate() returns for it: the image, or the video's list of frames."""
        return self.frames if self.frames is not None else self.image

    @property
    def num_generated_tokens(self) -> int:
        return 0  # images generate no tokens (the cluster's row counters add this up)


@dataclass(slots=True)
class ImageResult:
    index: int
    png: bytes | None
    error: str | None
    finished_at: float       # time.time() on the worker
    worker: str              # the worker that decoded it
    migrated: bool = False
    degrees: tuple[int, ...] = ()   # elastic runs: the sequence-parallel degree of each step
    array: Any = None        # keep_arrays: [H, W, 3] float32 before quantisation (a video's [F, H, W, 3])
    frames: list[bytes] | None = None  # a video's frames as PNG bytes (png is None then)


def png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
