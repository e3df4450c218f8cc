"""The text side of SD3 and Flux: their two or three encoders put together as diffusers' pipelines
do (encode_prompt), over our CLIP (clip.py) and T5 (t5.py) encoders.

SD3: CLIP-L's and CLIP-G's penultimate hidden states side by side, zero-padded to T5's width, then
T5's tokens (zeros where the pipeline has no T5); pooled = both CLIP projections side by side.
Flux: T5's tokens; pooled = CLIP-L's pooler output. Neither passes an attention mask.

Shapes: B prompts, Lc CLIP tokens (77), Lt T5 tokens (max_sequence_length), D joint width.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import UnsupportedModelError
from .clip import CLIPTextEncoder, CLIPTokens
from .t5 import T5Encoder, T5Tokens

# family -> (folder, class the encoder must be), in diffusers' order
ENCODERS = {"sd3": (("text_encoder", "CLIPTextModelWithProjection"), ("text_encoder_2", "CLIPTextModelWithProjection"),
                    ("text_encoder_3", "T5EncoderModel")),
            "flux": (("text_encoder", "CLIPTextModel"), ("text_encoder_2", "T5EncoderModel"))}


@dataclass
class MMDiTText:
    family: str
    clips: list[tuple[CLIPTextEncoder, CLIPTokens]]
    t5: tuple[T5Encoder, T5Tokens] | None
    max_sequence_length: int
    joint_dim: int       # the transformer's joint_attention_dim: T5's width, or the zeros' without T5
    dtype: torch.dtype

    @classmethod
    def load(cls, family: str, root: Path, index: dict[str, Any], dtype: torch.dtype, device: str,
             max_sequence_length: int, joint_dim: int) -> MMDiTText:
        clips, t5 = [], None
        for folder, want in ENCODERS[family]:
            entry = index.get(folder)
            if not entry or entry[1] is None:  # only SD3's T5 may be absent (read_index checks the rest)
                continue
            if entry[1] != want:
                raise UnsupportedModelError(f"{root}: {folder} class {entry[1]!r} is not supported (expected {want})")
            tok_folder = root / folder.replace("text_encoder", "tokenizer")
            if want == "T5EncoderModel":
                t5 = (T5Encoder(root / folder, dtype, device), T5Tokens(tok_folder))
            else:
                enc = CLIPTextEncoder(root / folder, dtype, device)
                if (want == "CLIPTextModelWithProjection") != enc.projects:
                    raise UnsupportedModelError(f"{root}: {folder} is a {want} by model_index.json but its weights "
                                                f"{'lack' if not enc.projects else 'have'} text_projection")
                clips.append((enc, CLIPTokens(tok_folder)))
        return cls(family, clips, t5, max_sequence_length, joint_dim, dtype)

    @property
    def clip_length(self) -> int:
        """Tokens every CLIP prompt is padded to: the first tokenizer's model_max_length, for both
        (diffusers' tokenizer_max_length)."""
        return self.clips[0][1].max_length

    @property
    def text_length(self) -> int:
        return self.max_sequence_length + (self.clip_length if self.family == "sd3" else 0)

    @property
    def device(self) -> torch.device:
        return self.clips[0][0].device

    def prompt_error(self, prompt: str) -> str | None:
        """A prompt longer than max_sequence_length T5 tokens is refused (diffusers would cut it);
        CLIP's 77 tokens are cut, as diffusers cuts them (T5 carries the rest)."""
        if self.t5 is None:
            return None
        n = self.t5[1].count(prompt)
        if n > self.max_sequence_length:
            return f"prompt is {n} tokens, longer than this pipeline's max_sequence_length {self.max_sequence_length}"
        return None

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> list[dict[str, torch.Tensor]]:
        """-> per prompt {"embeds": [L, D], "pooled": [P]} (SD3: L = Lc + Lt; Flux: L = Lt)."""
        states, pooled = [], []
        for enc, tok in self.clips:
            hidden, pool = enc(tok.batch(prompts, self.clip_length).to(enc.device))
            states.append(hidden)
            pooled.append(pool)
        t5 = self._t5(prompts)
        if self.family == "flux":
            embeds, pool = t5, pooled[0]
        else:
            clip = torch.cat(states, dim=-1)
            clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
            embeds, pool = torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1)
        return [{"embeds": embeds[i], "pooled": pool[i]} for i in range(len(prompts))]

    def _t5(self, prompts: list[str]) -> torch.Tensor:
        if self.t5 is None:
            return torch.zeros((len(prompts), self.max_sequence_length, self.joint_dim), dtype=self.dtype,
                               device=self.device)
        enc, tok = self.t5
        ids, _ = tok.batch(prompts, self.max_sequence_length)
        # no mask, as SD3 and Flux encode: the padding attends too (ones add an exact 0 to the bias)
        return enc(ids.to(enc.device), attention_mask=torch.ones_like(ids, device=enc.device))
