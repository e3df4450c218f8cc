"""Conditioning, computed once per request at admission: DiT class labels, PixArt T5 embeddings,
SD3 / Flux joint text embeddings and pooled vectors (mmdit_text.py), Wan's UMT5 embeddings."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .pipeline import MMDIT
from .wan import prompt_clean, text_rows

if TYPE_CHECKING:
    from .pipeline import Pipeline


def prompt_error(pipe: Pipeline, prompt: str) -> str | None:
    """A prompt longer than the pipeline's padded length is refused (diffusers would cut it)."""
    if pipe.family in MMDIT:
        return pipe.text_encoder.prompt_error(prompt)
    n = pipe.tokenizer.count(prompt_clean(prompt) if pipe.family == "wan" else prompt)
    if n > pipe.max_sequence_length:
        return f"prompt is {n} tokens, longer than this pipeline's max_sequence_length {pipe.max_sequence_length}"
    return None


@torch.no_grad()
def encode_prompts(pipe: Pipeline, prompts: list[str]) -> list[dict[str, torch.Tensor]]:
    """-> per prompt {"embeds": [L, D], "mask": [L]} (L = max_sequence_length, padded as PixArt);
    SD3 / Flux: {"embeds": [L, D], "pooled": [P]}; Wan: {"embeds": [L, D]}, its prompts cleaned and
    the rows past each prompt's tokens zeroed, as WanPipeline's."""
    if pipe.family in MMDIT:
        return [{k: v.to(pipe.transformer.dtype) for k, v in c.items()} for c in pipe.text_encoder.encode(prompts)]
    wan = pipe.family == "wan"
    ids, mask = pipe.tokenizer.batch([prompt_clean(p) for p in prompts] if wan else prompts, pipe.max_sequence_length)
    device = pipe.text_encoder.device
    mask = mask.to(device)
    embeds = pipe.text_encoder(ids.to(device), attention_mask=mask)
    embeds = embeds.to(pipe.transformer.dtype)
    if wan:
        embeds = text_rows(embeds, mask)
        return [{"embeds": embeds[i]} for i in range(len(prompts))]
    return [{"embeds": embeds[i], "mask": mask[i]} for i in range(len(prompts))]
