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
    if req.num_frames is not None and not pipe.is_video:
        return (f"num_frames {req.num_frames}: this {pipe.pipeline_class} makes images, not videos; "
                f"leave num_frames unset")
    if pipe.family == "dit":
        if req.prompt is not None:
            return "this DiT pipeline is class-conditional: give class_label, not prompt"
        n = len(pipe.id2label) if pipe.id2label else pipe.null_class
        if not 0 <= req.class_label < n:
            return f"class_label {req.class_label} is not one of this model's {n} classes (0..{n - 1})"
    else:
        if req.prompt is None:
            return f"this pipeline is text-to-{'video' if pipe.is_video else 'image'}: give prompt, not class_label"
        err = prompt_error(pipe, req.prompt)
        if err:
            return err
    m = pipe.pixel_multiple
    h, w = req.height or pipe.native_hw[0], req.width or pipe.native_hw[1]
    for name, value in (("height", h), ("width", w)):
        if value % m:
            return (f"{name} {value} is not a multiple of {m} (patch {pipe.patch_size} x VAE factor "
                    f"{pipe.vae_scale_factor})")
    frames = req.num_frames or pipe.default_frames
    if frames is not None:
        err = frames_error(pipe, frames, h, w)
        if err:
            return err
    tokens = pipe.tokens(h, w, frames)
    if tokens > max_image_tokens:
        nh, nw = pipe.native_hw
        what = f"{h}x{w} px" + (f" x {frames} frames" if frames is not None else "")
        return (f"{what} is {tokens:,} image tokens, over this engine's max_image_tokens "
                f"{max_image_tokens:,} ({IMAGE_TOKENS_OVER_NATIVE}x the model's native "
                f"{nh}x{nw}{'' if frames is None else f' x {pipe.default_frames} frames'}, unless set): attention "
                f"over them would not finish or fit; pass max_image_tokens to allow it")
    return None


def frames_error(pipe: Any, frames: int, height: int, width: int) -> str | None:
    """A video's frame count the VAE cannot compress (Wan: 4k + 1), or one whose latent frames,
    rows or columns run past the transformer's rotary table."""
    k = pipe.temporal_factor
    if (frames - 1) % k:
        return (f"num_frames {frames} is not {k}k + 1 (the VAE keeps the first frame and compresses each "
                f"{k} after it into one latent frame): e.g. {k + 1}, {2 * k + 1}, {pipe.default_frames}")
    limit = int(pipe.transformer.config.rope_max_seq_len)
    m = pipe.pixel_multiple
    for name, value, n in (("num_frames", frames, pipe.latent_frames(frames)), ("height", height, height // m),
                           ("width", width, width // m)):
        if n > limit:
            return (f"{name} {value} is {n} token positions, over the transformer's rope_max_seq_len {limit}")
    return None
