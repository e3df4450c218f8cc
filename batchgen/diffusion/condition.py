"""Conditioning, computed once per request at admission: DiT class labels, PixArt T5 embeddings."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .pipeline import Pipeline


def prompt_error(pipe: Pipeline, prompt: str) -> str | None:
    """A prompt longer than the pipeline's padded length is refused (diffusers would cut it)."""
    n = len(pipe.tokenizer(prompt, add_special_tokens=True).input_ids)
    if n > pipe.max_sequence_length:
        return f"prompt is {n} tokens, longer than this pipeline's max_sequence_length {pipe.max_sequence_length}"
    return None


@torch.no_grad()
def encode_prompts(pipe: Pipeline, prompts: list[str]) -> list[dict[str, torch.Tensor]]:
    """-> per prompt {"embeds": [L, D], "mask": [L]} (L = max_sequence_length, padded as PixArt)."""
    tok = pipe.tokenizer(prompts, padding="max_length", max_length=pipe.max_sequence_length, truncation=True,
                         add_special_tokens=True, return_tensors="pt")
    device = pipe.text_encoder.device
    mask = tok.attention_mask.to(device)
    embeds = pipe.text_encoder(tok.input_ids.to(device), attention_mask=mask)[0]
    embeds = embeds.to(pipe.transformer.dtype)
    return [{"embeds": embeds[i], "mask": mask[i]} for i in range(len(prompts))]
