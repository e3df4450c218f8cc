"""Which image requests a pipeline can run: the checks a request passes before it is queued."""
from __future__ import annotations

from typing import Any

from ..models.condition import prompt_error
from .request import ImageRequest

# Default cap on one request's image tokens, as a multiple of the model's native size (16: four
# times the native side). Attention is quadratic in the tokens: a 16384 x 16384 px request on a
# 256 px DiT (1M tokens) would run for hours or exhaust memory instead of failing.
IMAGE_TOKENS_OVER_NATIVE = 16


def request_error(pipe: Any, req: ImageRequest, max_image_tokens: int) -> str | None:
    """What makes `req` impossible on `pipe` (a message naming the field and the value), or None."""
    err = req.basic_error()
    if err:
        return err
    if req.guidance_scale is not None and not pipe.has_guidance:
        return (f"guidance_scale {req.guidance_scale!r}: this {pipe.pipeline_class} has no guidance (a distilled "
                f"model without guidance_embeds, e.g. Flux.1-schnell); leave guidance_scale unset")
    if pipe.family == "dit":
        if req.prompt is not None:
            return "this DiT pipeline is class-conditional: give class_label, not prompt"
        n = len(pipe.id2label) if pipe.id2label else pipe.null_class
        if not 0 <= req.class_label < n:
            return f"class_label {req.class_label} is not one of this model's {n} classes (0..{n - 1})"
    else:
        if req.prompt is None:
            return "this pipeline is text-to-image: give prompt, not class_label"
        err = prompt_error(pipe, req.prompt)
        if err:
            return err
    m = pipe.pixel_multiple
    for name in ("height", "width"):
        value = getattr(req, name) or pipe.native_size
        if value % m:
            return (f"{name} {value} is not a multiple of {m} (patch {pipe.patch_size} x VAE factor "
                    f"{pipe.vae_scale_factor})")
    h, w = req.height or pipe.native_size, req.width or pipe.native_size
    tokens = (h // m) * (w // m)
    if tokens > max_image_tokens:
        return (f"{h}x{w} px is {tokens:,} image tokens, over this engine's max_image_tokens "
                f"{max_image_tokens:,} ({IMAGE_TOKENS_OVER_NATIVE}x the model's native "
                f"{pipe.native_size}x{pipe.native_size}, unless set): attention over them would not finish "
                f"or fit; pass max_image_tokens to allow it")
    return None
