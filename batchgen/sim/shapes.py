"""A model's shapes as the cost model needs them: bytes to read, FLOPs per token, KV per token.

Read from config.json through the same parser the loader uses (models/families.py), so a model
the runtime refuses is refused here too. Counts are per forward; dtype is the serving dtype.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ..models.families import parse_config
from ..models.spec import GQASpec, MLASpec, ModelSpec, MoESpec

# Shipped model shapes (config.json files as published on the Hugging Face hub).
BUILTIN_MODELS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Per-forward sizes. `dense_params`: weights every token reads (attention, norms, dense
    FFNs, shared experts, router, embeddings, lm_head); experts are counted per MoE layer."""

    name: str
    dense_params: int
    expert_params: int  # one routed expert of one layer
    num_experts: int  # routed experts per MoE layer (0: a dense model)
    top_k: int
    num_moe_layers: int
    active_params_per_token: int  # dense + top_k experts per MoE layer
    kv_elems_per_token: int  # cached floats per token, all layers
    attn_flops_per_pair: int  # FLOPs per (query token, context token) pair, all layers
    bytes_per_param: int = 2

    def __post_init__(self) -> None:
        if self.dense_params <= 0 or self.kv_elems_per_token <= 0:
            raise PlanError(f"model shape {self.name!r} has no weights or no KV cache")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_elems_per_token * self.bytes_per_param

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * self.bytes_per_param

    @property
    def total_expert_bytes(self) -> int:
        return self.num_experts * self.num_moe_layers * self.expert_bytes

    @property
    def dense_bytes(self) -> int:
        return self.dense_params * self.bytes_per_param

    @property
    def weight_bytes(self) -> int:
        return self.dense_bytes + self.total_expert_bytes


def _attention(a: GQASpec | MLASpec, hidden: int) -> tuple[int, int, int]:
    """-> (weight params, cached floats per token, FLOPs per query-context pair) of one layer."""
    if isinstance(a, GQASpec):
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        return hidden * (q + 2 * kv) + q * hidden, a.kv_width, 4 * q
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = hidden * a.q_lora_rank + a.q_lora_rank * a.num_heads * qk if a.q_lora_rank else hidden * a.num_heads * qk
    kv = hidden * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
    # absorbed MLA decode: scores over the latent + rope part, values over the latent
    return q + kv + a.num_heads * a.v_head_dim * hidden, a.kv_width, 2 * a.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim)


def shape_from_spec(spec: ModelSpec, name: str, bytes_per_param: int = 2) -> ModelShape:
    h = spec.hidden_size
    dense = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    kv = flops_pair = moe_layers = experts = top_k = expert = 0
    for layer in spec.layers:
        w, k, f = _attention(layer.attention, h)
        dense += w + 2 * h
        kv += k
        flops_pair += f
        ffn = layer.ffn
        if isinstance(ffn, MoESpec):
            moe_layers += 1
            experts, top_k = ffn.router.num_experts, ffn.router.top_k
            if not 1 <= top_k <= experts:
                raise PlanError(f"model {name!r}: experts per token {top_k} must be in [1, {experts} routed experts]")
            expert = 3 * h * ffn.intermediate_size
            dense += 3 * h * ffn.shared_intermediate_size + h * experts
        else:
            dense += 3 * h * ffn.intermediate_size
    return ModelShape(name, dense, expert, experts, top_k, moe_layers, dense + moe_layers * top_k * expert,
                      kv, flops_pair, bytes_per_param)


def load_shape(model: str | Path, bytes_per_param: int = 2) -> ModelShape:
    """A model directory (its config.json) or a shipped name (BUILTIN_MODELS); a directory of
    that name with a config.json wins over the shipped shapes."""
    if isinstance(model, str) and model in BUILTIN_MODELS and not (Path(model) / "config.json").is_file():
        text = (resources.files("batchgen.sim") / "models" / f"{model}.json").read_text(encoding="utf-8")
        return shape_from_spec(parse_config(json.loads(text)), model, bytes_per_param)
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise PlanError(f"--model {model}: no config.json there (and not a shipped model: {', '.join(BUILTIN_MODELS)})")
    try:
        cfg: dict[str, Any] = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PlanError(f"--model {model}: cannot read {config}: {exc}") from exc
    return shape_from_spec(parse_config(cfg), path.name, bytes_per_param)
