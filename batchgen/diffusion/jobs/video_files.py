"""A finished video on disk: its frames as PNGs in a folder, and an MP4 beside it where the
optional `video` extra (PyAV) is installed.

Frames are always written (lossless, and readable without a codec); the MP4 is H.264 at Wan
2.1's 16 frames per second (yuv420p: any player; Wan's sizes are multiples of 16, so even).
"""
from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FPS = 16


@dataclass(frozen=True, slots=True)
class VideoFiles:
    frames_dir: Path
    mp4: Path | None  # None without PyAV

    @property
    def main(self) -> Path:
        """The MP4 where there is one, else the frames' folder."""
        return self.mp4 if self.mp4 is not None else self.frames_dir


def can_write_mp4() -> bool:
    return importlib.util.find_spec("av") is not None


def write_video(folder: Path, stem: str, frames: Sequence[Any]) -> VideoFiles:
    """frames: PIL images -> <folder>/<stem>/00000.png ... and <folder>/<stem>.mp4."""
    frames_dir = folder / stem
    frames_dir.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        frame.save(frames_dir / f"{i:05d}.png", format="PNG")
    mp4 = folder / f"{stem}.mp4" if can_write_mp4() else None
    if mp4 is not None:
        _encode(mp4, frames)
    return VideoFiles(frames_dir, mp4)


def _encode(path: Path, frames: Sequence[Any]) -> None:
    import av
    import numpy as np

    width, height = frames[0].size
    # written whole or not at all: a failed encode or a concurrent writer of the same request
    # never leaves a truncated file at the final name
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with av.open(str(tmp), "w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=FPS)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for frame in frames:
                out.mux(stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame.convert("RGB")), format="rgb24")))
            out.mux(stream.encode())  # an empty encode drains the frames the encoder still holds
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
