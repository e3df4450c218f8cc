"""A checkpoint's config.json, normalized into one description every family shares.

Families (mixtral, qwen2_moe, deepseek_v3, ...) differ only in how they spell the same choices;
`families.py` turns each spelling into these dataclasses, and the model code reads nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding over `dim` channels of each head (`interleaved`: pairs (x0,x1),(x2,x3)...)."""

    theta: float
    dim: int
    kind: Literal["default", "linear", "dynamic", "llama3", "yarn"] = "default"
    factor: float = 1.0
    interleaved: bool = False
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class GQASpec:
    """Grouped-query attention (MHA when num_kv_heads == num_heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Literal["none", "head", "full"] = "none"  # head: per head_dim (qwen3); full: whole projection (olmoe)
    clip_qkv: float | None = None
    sliding_window: int | None = None

    @property
    def kv_width(self) -> int:  # floats cached per token: K and V
        return 2 * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class MLASpec:
    """DeepSeek multi-head latent attention; the cache holds [kv_lora_rank + rope_dim] per token."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False
    softmax_scale: float = 1.0

    @property
    def kv_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class DenseMLPSpec:
    intermediate_size: int
    bias: bool = False


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How router logits become (weights, expert ids) per token."""

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: Literal["max", "top2sum"] = "max"
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False


@dataclass(frozen=True, slots=True)
class MoESpec:
    router: RouterSpec
    intermediate_size: int
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # qwen2_moe: sigmoid(Linear(hidden, 1)) scales the shared expert


@dataclass(frozen=True, slots=True)
class LayerSpec:
    attention: GQASpec | MLASpec
    ffn: DenseMLPSpec | MoESpec

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, MoESpec)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope: RopeSpec
    layers: tuple[LayerSpec, ...]
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # weight name prefix of each layer's FFN module, per family ("mlp", "block_sparse_moe")
    ffn_prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_width(self) -> int:
        return self.layers[0].attention.kv_width
