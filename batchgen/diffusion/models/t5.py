"""The T5 text encoders (PixArt, SD3, Flux; UMT5 for Wan): a plain-torch T5 encoder read from its
safetensors, and its tokenizer read with `tokenizers` from tokenizer.json. transformers'
T5EncoderModel / UMT5EncoderModel are the test oracles, not runtime dependencies.

UMT5 is T5 v1.1 with one relative position bias table per layer (T5 shares layer 0's).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import ModelLoadError, UnsupportedModelError
from .encoder_weights import load_encoder_weights

_ACTIVATIONS = {"relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class T5Config:
    d_model: int
    d_kv: int
    num_heads: int
    num_layers: int
    num_buckets: int
    max_distance: int
    eps: float
    gated: bool
    act: str
    bias_per_layer: bool = False  # UMT5: every layer has its own relative_attention_bias

    @classmethod
    def read(cls, path: Path) -> T5Config:
        cfg = json.loads((path / "config.json").read_text())
        proj = str(cfg.get("feed_forward_proj", "relu"))
        gated = proj.startswith("gated-")
        act = proj.split("-", 1)[1] if gated else proj
        act = "gelu_new" if act == "gelu" and gated else act  # transformers' T5 maps gated-gelu to gelu_new
        act = str(cfg.get("dense_act_fn", act))
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{path}: T5 activation {act!r} is not supported")
        return cls(int(cfg["d_model"]), int(cfg["d_kv"]), int(cfg["num_heads"]), int(cfg["num_layers"]),
                   int(cfg.get("relative_attention_num_buckets", 32)), int(cfg.get("relative_attention_max_distance", 128)),
                   float(cfg.get("layer_norm_epsilon", 1e-6)), gated, act, cfg.get("model_type") == "umt5")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """T5's layer norm: scale only, no mean subtracted, statistics in fp32."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return w * (x.float() * torch.rsqrt(var + eps)).to(w.dtype)


def _bucket(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Bidirectional relative-position buckets (T5): half per direction, exact near, log far."""
    half = num_buckets // 2
    out = (relative > 0).long() * half
    n = relative.abs()
    exact = half // 2
    far = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact) * (half - exact)).long()
    far = far.clamp(max=half - 1)
    return out + torch.where(n < exact, n, far)


class T5Encoder:
    """encoder(input_ids [B, L], attention_mask [B, L]) -> last hidden state [B, L, d_model]."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str) -> None:
        self.config = T5Config.read(path)
        self.w = load_encoder_weights(path, "T5 encoder", dtype, device)
        self.device = torch.device(device)
        self.dtype = dtype
        embed = self.w.get("encoder.embed_tokens.weight", self.w.get("shared.weight"))
        if embed is None:
            raise ModelLoadError(f"{path}: T5 weights without an embedding table")
        self.embed = embed
        missing = [k for k in self._needed() if k not in self.w]
        if missing:
            raise ModelLoadError(f"{path}: T5 weights missing for its config.json: {', '.join(missing[:3])}"
                                 f"{' ...' if len(missing) > 3 else ''} ({len(missing)} tensors)")

    def _needed(self) -> list[str]:
        """The tensor names __call__ reads, for the config's layer count and feed-forward kind."""
        c = self.config
        ff = ("wi_0", "wi_1", "wo") if c.gated else ("wi", "wo")
        names = ["encoder.final_layer_norm.weight"]
        for i in range(c.num_layers):
            p = f"encoder.block.{i}.layer."
            if i == 0 or c.bias_per_layer:
                names.append(p + "0.SelfAttention.relative_attention_bias.weight")
            names += [p + "0.layer_norm.weight", p + "1.layer_norm.weight"]
            names += [p + f"0.SelfAttention.{n}.weight" for n in "qkvo"]
            names += [p + f"1.DenseReluDense.{n}.weight" for n in ff]
        return names

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        c, w = self.config, self.w
        B, L = ids.shape
        h = F.embedding(ids, self.embed)
        pos = torch.arange(L, device=ids.device)
        buckets = _bucket(pos[None, :] - pos[:, None], c.num_buckets, c.max_distance)  # [L, L]: key - query
        masked = (1.0 - attention_mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min  # [B, 1, 1, L]
        for i in range(c.num_layers):
            p = f"encoder.block.{i}.layer."
            if i == 0 or c.bias_per_layer:
                table = w[p + "0.SelfAttention.relative_attention_bias.weight"]
                bias = table[buckets].permute(2, 0, 1).unsqueeze(0) + masked  # [B, H, L, L]
            x = _rms(h, w[p + "0.layer_norm.weight"], c.eps)
            q, k, v = (F.linear(x, w[p + f"0.SelfAttention.{n}.weight"]).view(B, L, c.num_heads, c.d_kv).transpose(1, 2)
                       for n in "qkv")
            scores = torch.matmul(q, k.transpose(-1, -2)) + bias  # T5 does not scale by 1/sqrt(d)
            attn = torch.matmul(F.softmax(scores.float(), dim=-1).to(q.dtype), v)
            h = h + F.linear(attn.transpose(1, 2).reshape(B, L, -1), w[p + "0.SelfAttention.o.weight"])
            x = _rms(h, w[p + "1.layer_norm.weight"], c.eps)
            act = _ACTIVATIONS[c.act]
            if c.gated:
                x = act(F.linear(x, w[p + "1.DenseReluDense.wi_0.weight"])) * F.linear(x, w[p + "1.DenseReluDense.wi_1.weight"])
            else:
                x = act(F.linear(x, w[p + "1.DenseReluDense.wi.weight"]))
            h = h + F.linear(x, w[p + "1.DenseReluDense.wo.weight"])
        return _rms(h, w["encoder.final_layer_norm.weight"], c.eps)


class T5Tokens:
    """The pipeline's T5 tokenizer from tokenizer.json (its post-processor appends </s>)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json (a sentencepiece-only tokenizer folder); write one with "
                                 "transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
        self.tok = Tokenizer.from_file(str(file))
        self.tok.no_padding()
        self.tok.no_truncation()
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        pad = cfg.get("pad_token", "<pad>")
        pad = pad.get("content", "<pad>") if isinstance(pad, dict) else pad
        pad_id = self.tok.token_to_id(pad)
        self.pad_id = 0 if pad_id is None else pad_id
        self.eos_id = self.tok.token_to_id("</s>")

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids)

    def batch(self, texts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ids, mask [B, length]: padded to `length`, longer prompts cut (keeping </s> last, as
        transformers' truncation does)."""
        ids = torch.full((len(texts), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(texts), length), dtype=torch.long)
        for i, enc in enumerate(self.tok.encode_batch(texts)):
            row = enc.ids
            if len(row) > length:
                row = row[:length - 1] + [self.eos_id] if self.eos_id is not None and row[-1] == self.eos_id else row[:length]
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        return ids, mask
