"""Weight containers: plain tensors in dataclasses, stacked [E, ...] for experts so routing is an index."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen_kernels.expert_tiles import ExpertTiles
from batchgen_kernels.tiled_linear import TiledWeight

Tensor = torch.Tensor


@dataclass(slots=True)
class MLPWeights:
    gate_up: Tensor | TiledWeight  # [2I, H]: gate rows then up rows (in tiles: fp32 on the CPU, from tiled_linear.TILE_BYTES)
    down: Tensor | TiledWeight  # [H, I]
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None


@dataclass(slots=True)
class MoEWeights:
    router: Tensor  # [E, H] (kept fp32, as transformers routes in fp32)
    w13: Tensor | None  # [E, 2N, H]: gate rows then up rows of each expert; None: in the expert store (batchgen/offload), or in `tiles`
    w2: Tensor | None  # [E, H, N]
    correction_bias: Tensor | None = None  # [E] deepseek_v3
    shared: MLPWeights | None = None
    shared_gate: Tensor | None = None  # [1, H] qwen2_moe
    tiles: ExpertTiles | None = None  # fp32 experts resident on the CPU, tiled for its kernel (w13 and w2 None then)


@dataclass(slots=True)
class GQAWeights:
    qkv: Tensor | TiledWeight  # [(Hq + 2 Hkv) D, H] (in tiles: fp32 on the CPU, from tiled_linear.TILE_BYTES)
    o: Tensor | TiledWeight  # [H, Hq D]
    qkv_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_norm: Tensor | None = None  # [D] (head) or [Hq D] (full)
    k_norm: Tensor | None = None


@dataclass(slots=True)
class MLAWeights:
    kv_a: Tensor  # [kv_lora_rank + rope_dim, H]
    kv_a_norm: Tensor  # [kv_lora_rank]
    kv_b: Tensor  # [Hq (nope + v), kv_lora_rank]
    o: Tensor  # [H, Hq v]
    q: Tensor | None = None  # [Hq (nope + rope), H] when q_lora_rank is None
    q_a: Tensor | None = None  # [q_lora_rank, H]
    q_a_norm: Tensor | None = None
    q_b: Tensor | None = None  # [Hq (nope + rope), q_lora_rank]
    kv_a_bias: Tensor | None = None
    q_a_bias: Tensor | None = None
    o_bias: Tensor | None = None


@dataclass(slots=True)
class LayerWeights:
    input_norm: Tensor
    post_norm: Tensor
    attention: GQAWeights | MLAWeights
    ffn: MLPWeights | MoEWeights


@dataclass(slots=True)
class ModelWeights:
    embed: Tensor  # [V, H]
    norm: Tensor  # [H]
    lm_head: Tensor | TiledWeight  # [V, H] (the embedding itself when tied; in tiles: untied fp32 on the CPU, from TILE_BYTES)
    layers: list[LayerWeights]
