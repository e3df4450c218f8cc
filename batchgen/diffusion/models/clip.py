"""CLIP text encoders (SD3's CLIP-L and CLIP-G, Flux's CLIP-L): plain torch over the safetensors,
and their byte-level BPE tokenizer read with `tokenizers`. transformers' CLIPTextModel /
CLIPTextModelWithProjection and CLIPTokenizer are the test oracles, not runtime dependencies.

Shapes: B prompts, L tokens (the tokenizer's model_max_length, 77), D hidden, P projection.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import ModelLoadError, UnsupportedModelError
from .encoder_weights import load_encoder_weights

_ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# transformers' CLIPTokenizer pre-tokenizer (its tokenizer.json, when a folder has one, says the same)
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


@dataclass(frozen=True, slots=True)
class CLIPConfig:
    hidden_size: int
    num_heads: int
    num_layers: int
    eps: float
    act: str
    eos_token_id: int

    @classmethod
    def read(cls, path: Path) -> CLIPConfig:
        cfg = json.loads((path / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)  # a full CLIPModel config nests the text part
        act = str(cfg.get("hidden_act", "quick_gelu"))
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{path}: CLIP activation {act!r} is not supported")
        return cls(int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"]),
                   float(cfg.get("layer_norm_eps", 1e-5)), act, int(cfg.get("eos_token_id", 2)))


class CLIPTextEncoder:
    """encoder(ids [B, L]) -> (penultimate hidden state [B, L, D], pooled [B, D or P]): pooled is the
    final-layer-normed state at each prompt's end token, through text_projection where the
    checkpoint has one (CLIPTextModelWithProjection's text_embeds, else CLIPTextModel's
    pooler_output). No attention mask: SD3 and Flux encode the padded ids with the causal mask only."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str) -> None:
        self.config = CLIPConfig.read(path)
        w = load_encoder_weights(path, "CLIP text encoder", dtype, device)
        # transformers 4 writes text_model.* (both classes); strip it so one set of names serves
        self.w = {k.removeprefix("text_model."): v for k, v in w.items()}
        self.device = torch.device(device)
        self.dtype = dtype
        missing = [k for k in self._needed() if k not in self.w]
        if missing:
            raise ModelLoadError(f"{path}: CLIP weights missing for its config.json: {', '.join(missing[:3])}"
                                 f"{' ...' if len(missing) > 3 else ''} ({len(missing)} tensors)")

    @property
    def projects(self) -> bool:
        return "text_projection.weight" in self.w

    def _needed(self) -> list[str]:
        names = ["embeddings.token_embedding.weight", "embeddings.position_embedding.weight",
                 "final_layer_norm.weight", "final_layer_norm.bias"]
        for i in range(self.config.num_layers):
            p = f"encoder.layers.{i}."
            for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                      "layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2"):
                names += [p + m + ".weight", p + m + ".bias"]
        return names

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], self.config.eps)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        B, L = ids.shape
        hd = c.hidden_size // c.num_heads
        h = F.embedding(ids, self.w["embeddings.token_embedding.weight"]) \
            + self.w["embeddings.position_embedding.weight"][:L]
        penultimate = h  # hidden_states[-2]: the last layer's input
        for i in range(c.num_layers):
            p = f"encoder.layers.{i}."
            penultimate = h
            x = self._norm(h, p + "layer_norm1")
            q, k, v = (self._linear(x, p + f"self_attn.{n}_proj").view(B, L, c.num_heads, hd).transpose(1, 2)
                       for n in "qkv")
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd ** -0.5)
            h = h + self._linear(attn.transpose(1, 2).reshape(B, L, -1), p + "self_attn.out_proj")
            x = self._linear(self._norm(h, p + "layer_norm2"), p + "mlp.fc1")
            h = h + self._linear(_ACTIVATIONS[c.act](x), p + "mlp.fc2")
        last = self._norm(h, "final_layer_norm")
        # the end token: the largest id under the legacy eos_token_id 2 (transformers' rule), else
        # the first position holding eos_token_id
        end = ids.argmax(-1) if c.eos_token_id == 2 else (ids == c.eos_token_id).int().argmax(-1)
        pooled = last[torch.arange(B, device=ids.device), end]
        if self.projects:
            pooled = F.linear(pooled, self.w["text_projection.weight"])
        return penultimate, pooled


class CLIPTokens:
    """A pipeline's CLIP tokenizer folder: tokenizer.json where there is one, else vocab.json +
    merges.txt (what SD3 and Flux snapshots ship) built as transformers' CLIPTokenizer builds it."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors
        from tokenizers.models import BPE

        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        bos, eos = _token(cfg, "bos_token", "<|startoftext|>"), _token(cfg, "eos_token", "<|endoftext|>")
        pad = _token(cfg, "pad_token", "<|endoftext|>")
        self.max_length = int(cfg.get("model_max_length") or 77)
        if self.max_length > 10**6:  # transformers' "no limit" sentinel
            self.max_length = 77
        if (path / "tokenizer.json").is_file():
            self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
            lines = (path / "merges.txt").read_text(encoding="utf-8").splitlines()
            merges = [tuple(m.split()) for m in lines if m.strip() and not m.startswith("#version")]
            self.tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                     end_of_word_suffix="</w>", fuse_unk=False, unk_token=_token(cfg, "unk_token", eos)))
            self.tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                                        normalizers.Lowercase()])
            self.tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False)])
            self.tok.post_processor = processors.RobertaProcessing((eos, vocab[eos]), (bos, vocab[bos]), False, False)
        else:
            raise ModelLoadError(f"{path}: a CLIP tokenizer needs tokenizer.json, or vocab.json and merges.txt")
        self.tok.no_padding()
        self.tok.no_truncation()
        self.eos_id = self.tok.token_to_id(eos)
        pad_id = self.tok.token_to_id(pad)
        if self.eos_id is None or pad_id is None:
            raise ModelLoadError(f"{path}: the CLIP vocabulary has no {eos!r} or {pad!r} token")
        self.pad_id = pad_id

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids)

    def batch(self, texts: list[str], length: int) -> torch.Tensor:
        """-> ids [B, length]: padded with the pad token; longer prompts cut, keeping the end token
        last (as transformers' truncation, and diffusers cuts them too)."""
        ids = torch.full((len(texts), length), self.pad_id, dtype=torch.long)
        for i, enc in enumerate(self.tok.encode_batch(texts)):
            row = enc.ids
            if len(row) > length:
                row = row[:length - 1] + [self.eos_id]
            ids[i, :len(row)] = torch.tensor(row)
        return ids


def _token(cfg: dict, key: str, default: str) -> str:
    value = cfg.get(key, default)
    return str(value.get("content", default) if isinstance(value, dict) else value)
