"""ImageRequest: one image (or video) to generate; bad values are reported per request, never raised in a batch."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ImageRequest:
    """prompt (text-to-image pipelines) or class_label (DiT); height/width in pixels (None: the
    model's native size); guidance_scale: None for the model's default (DiT, PixArt 4.0, SD3 7.0,
    Flux-dev 3.5; Flux-schnell has no guidance and refuses one); > 1 turns classifier-free guidance
    on for DiT, PixArt and SD3 (as diffusers); Flux-dev's is its distilled guidance input.
    num_frames: a video's frames (diffusers' name; Wan: 4k + 1, None for its default 81); an image
    model refuses it. Wan's guidance default is 5.0, its negative prompt the empty string."""

    prompt: str | None = None
    class_label: int | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int = 20
    guidance_scale: float | None = None
    seed: int = 0
    num_frames: int | None = None

    def __post_init__(self) -> None:
        # numpy integers and floats (a DataFrame's cells) as the plain values they stand for
        for name in ("class_label", "height", "width", "num_inference_steps", "seed", "num_frames"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, int(value))
        if isinstance(self.guidance_scale, numbers.Real) and not isinstance(self.guidance_scale, (bool, int, float)):
            object.__setattr__(self, "guidance_scale", float(self.guidance_scale))

    def basic_error(self) -> str | None:
        """What is wrong regardless of the model, or None."""
        if not isinstance(self.num_inference_steps, int) or isinstance(self.num_inference_steps, bool) \
                or self.num_inference_steps <= 0:
            return f"num_inference_steps must be a positive integer, got {self.num_inference_steps!r}"
        if self.guidance_scale is not None and (
                not isinstance(self.guidance_scale, (int, float)) or isinstance(self.guidance_scale, bool)
                or not math.isfinite(self.guidance_scale) or self.guidance_scale < 0):
            return f"guidance_scale must be a finite number >= 0, got {self.guidance_scale!r}"
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            return f"seed must be an integer in [0, 2**63), got {self.seed!r}"
        for name in ("height", "width", "num_frames"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                return f"{name} must be a positive integer, got {value!r}"
        if (self.prompt is None) == (self.class_label is None):
            return "give exactly one of prompt and class_label"
        if self.prompt is not None and not isinstance(self.prompt, str):
            return f"prompt must be a string, got {type(self.prompt).__name__}"
        if self.class_label is not None and (not isinstance(self.class_label, int) or isinstance(self.class_label, bool)):
            return f"class_label must be an integer, got {self.class_label!r}"
        return None
