"""config.json of each supported family -> ModelSpec; anything we do not implement is refused here.

The rules mirror what transformers honours for each family (it is our oracle): which layers are
sparse, which projections carry biases, which layers slide their attention window.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..errors import UnsupportedModelError
from .spec import DenseMLPSpec, GQASpec, LayerSpec, MLASpec, ModelSpec, MoESpec, RopeSpec, RouterSpec

Config = dict[str, Any]
_ROPE_KINDS = {"default", "linear", "dynamic", "llama3", "yarn"}


def _require(cfg: Config, key: str) -> Any:
    if cfg.get(key) is None:
        raise UnsupportedModelError(f"config.json lacks required field {key!r} for model_type {cfg.get('model_type')!r}")
    return cfg[key]


def _rope_parameters(cfg: Config) -> dict[str, Any]:
    """Both spellings: transformers>=5 `rope_parameters`, older snapshots `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        params = {**dict(cfg["rope_scaling"]), **params}
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    params["rope_type"] = kind
    return params


def parse_rope(cfg: Config, dim: int, interleaved: bool = False) -> RopeSpec:
    p = _rope_parameters(cfg)
    kind = p["rope_type"]
    if kind not in _ROPE_KINDS:
        raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (supported: {sorted(_ROPE_KINDS)})")
    partial = float(p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    factor = p.get("factor")
    orig = cfg.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
    if kind == "yarn" and factor is None:
        factor = cfg["max_position_embeddings"] / orig if orig else 1.0
    if kind in ("linear", "dynamic", "llama3", "yarn") and factor is None:
        raise UnsupportedModelError(f"rope scaling {kind!r} needs a 'factor'")
    return RopeSpec(
        theta=float(p["rope_theta"]),
        dim=int(dim * partial),
        kind=kind,
        factor=float(factor or 1.0),
        interleaved=interleaved,
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig or cfg.get("max_position_embeddings", 0)) or None,
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        attention_factor=p.get("attention_factor"),
        truncate=bool(p.get("truncate", True)),
    )


def _common(cfg: Config) -> dict[str, Any]:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return dict(
        family=cfg["model_type"],
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=int(_require(cfg, "hidden_size")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"),
    )


def _head_dim(cfg: Config) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _gqa(cfg: Config, *, qkv_bias: bool, o_bias: bool, qk_norm: str = "none",
         sliding_window: int | None = None) -> GQASpec:
    heads = int(_require(cfg, "num_attention_heads"))
    return GQASpec(num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=_head_dim(cfg), qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,  # type: ignore[arg-type]
                   clip_qkv=cfg.get("clip_qkv"), sliding_window=sliding_window)


def _layer_types(cfg: Config, default: Callable[[int], bool]) -> list[bool]:
    """Per layer: does it use the sliding window?"""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        types = cfg["layer_types"]
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(f"layer_types {sorted(unknown)} are not supported")
        return [t == "sliding_attention" for t in types[:n]]
    return [default(i) for i in range(n)]


def _qwen_sparse(cfg: Config, i: int) -> bool:
    return (i not in (cfg.get("mlp_only_layers") or [])) and (cfg.get("num_experts") or 0) > 0 and \
        (i + 1) % int(cfg.get("decoder_sparse_step", 1)) == 0


def _llama_like(cfg: Config) -> ModelSpec:
    mt = cfg["model_type"]
    if mt == "qwen2":
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        sliding = _layer_types(cfg, lambda i: window is not None and i >= cfg.get("max_window_layers", 28))
        attn = lambda i: _gqa(cfg, qkv_bias=True, o_bias=False, sliding_window=window if sliding[i] else None)
        mlp_bias = False
    else:
        bias = bool(cfg.get("attention_bias", False))
        attn = lambda i: _gqa(cfg, qkv_bias=bias, o_bias=bias)
        mlp_bias = bool(cfg.get("mlp_bias", False))
    ffn = DenseMLPSpec(int(_require(cfg, "intermediate_size")), bias=mlp_bias)
    layers = tuple(LayerSpec(attn(i), ffn) for i in range(cfg["num_hidden_layers"]))
    return ModelSpec(**_common(cfg), rope=parse_rope(cfg, _head_dim(cfg)), layers=layers)


def _mixtral(cfg: Config) -> ModelSpec:
    window = cfg.get("sliding_window")
    router = RouterSpec(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                        norm_topk_prob=True)
    moe = MoESpec(router, intermediate_size=int(cfg["intermediate_size"]))
    layers = tuple(LayerSpec(_gqa(cfg, qkv_bias=False, o_bias=False, sliding_window=window), moe)
                   for _ in range(cfg["num_hidden_layers"]))
    return ModelSpec(**_common(cfg), rope=parse_rope(cfg, _head_dim(cfg)), layers=layers,
                     ffn_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"))


def _qwen_moe(cfg: Config) -> ModelSpec:
    mt = cfg["model_type"]
    router = RouterSpec(num_experts=int(cfg.get("num_experts") or 0), top_k=int(cfg.get("num_experts_per_tok", 1)),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", mt == "qwen3_moe")))
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
    moe = MoESpec(router, intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                  shared_intermediate_size=shared, shared_gate=shared > 0)
    dense = DenseMLPSpec(int(_require(cfg, "intermediate_size")))
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
    if mt == "qwen2_moe":
        sliding = _layer_types(cfg, lambda i: bool((i + 1) % 2) and i < cfg.get("max_window_layers", 28)
                               and window is not None)
        bias = bool(cfg.get("qkv_bias", True))
        attn = lambda i: _gqa(cfg, qkv_bias=bias, o_bias=False, sliding_window=window if sliding[i] else None)
    else:
        bias = bool(cfg.get("attention_bias", False))
        attn = lambda i: _gqa(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head", sliding_window=window)
    layers = tuple(LayerSpec(attn(i), moe if _qwen_sparse(cfg, i) else dense) for i in range(cfg["num_hidden_layers"]))
    return ModelSpec(**_common(cfg), rope=parse_rope(cfg, _head_dim(cfg)), layers=layers)


def _olmoe(cfg: Config) -> ModelSpec:
    router = RouterSpec(num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    moe = MoESpec(router, intermediate_size=int(cfg["intermediate_size"]))
    bias = bool(cfg.get("attention_bias", False))
    layers = tuple(LayerSpec(_gqa(cfg, qkv_bias=bias, o_bias=bias, qk_norm="full",
                                  sliding_window=cfg.get("sliding_window")), moe)
                   for _ in range(cfg["num_hidden_layers"]))
    return ModelSpec(**_common(cfg), rope=parse_rope(cfg, _head_dim(cfg)), layers=layers)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _deepseek(cfg: Config) -> ModelSpec:
    v3 = cfg["model_type"] == "deepseek_v3"
    rope_dim = int(cfg["qk_rope_head_dim"])
    rope = parse_rope(cfg, rope_dim, interleaved=bool(cfg.get("rope_interleave", True)) if v3 else True)
    qk_head_dim = int(cfg["qk_nope_head_dim"]) + rope_dim
    scale = qk_head_dim ** -0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, float(rope.mscale_all_dim))
        scale *= m * m
    attn = MLASpec(num_heads=int(cfg["num_attention_heads"]), q_lora_rank=cfg.get("q_lora_rank"),
                   kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
                   qk_rope_head_dim=rope_dim, v_head_dim=int(cfg["v_head_dim"]),
                   attention_bias=bool(cfg.get("attention_bias", False)), softmax_scale=scale)
    n_experts = cfg.get("n_routed_experts")
    if v3:
        router = RouterSpec(num_experts=int(n_experts), top_k=int(cfg["num_experts_per_tok"]), scoring="sigmoid",
                            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                            num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
                            group_score="top2sum",
                            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                            has_correction_bias=True)
    elif n_experts:
        method = cfg.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"deepseek_v2 topk_method {method!r} is not supported")
        grouped = method == "group_limited_greedy"
        router = RouterSpec(num_experts=int(n_experts), top_k=int(cfg["num_experts_per_tok"]),
                            num_groups=int(cfg.get("n_group") or 1) if grouped else 1,
                            topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
                            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)))
    if n_experts and router.num_experts % router.num_groups:
        raise UnsupportedModelError(f"n_routed_experts={n_experts} is not divisible by n_group={router.num_groups}")
    mlp_bias = bool(cfg.get("mlp_bias", False))
    dense = DenseMLPSpec(int(cfg["intermediate_size"]), bias=mlp_bias)
    freq, first_dense = int(cfg.get("moe_layer_freq", 1)), int(cfg.get("first_k_dense_replace", 0))

    def ffn(i: int) -> DenseMLPSpec | MoESpec:
        if n_experts and i >= first_dense and i % freq == 0:
            return MoESpec(router, intermediate_size=int(cfg["moe_intermediate_size"]),
                           shared_intermediate_size=int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0))
        return dense

    layers = tuple(LayerSpec(attn, ffn(i)) for i in range(cfg["num_hidden_layers"]))
    return ModelSpec(**_common(cfg), rope=rope, layers=layers)


_EXPERT_ALIASES = ("num_experts", "num_local_experts", "n_routed_experts")

FAMILIES: dict[str, Callable[[Config], ModelSpec]] = {
    "llama": _llama_like,
    "qwen2": _llama_like,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "olmoe": _olmoe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}


def parse_config(cfg: Config) -> ModelSpec:
    """Normalize a config.json dict; raise UnsupportedModelError naming what is not supported."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        arch = cfg.get("architectures")
        raise UnsupportedModelError(
            f"model_type {mt!r} (architectures {arch}) is not supported; supported: {sorted(FAMILIES)}")
    if cfg.get("quantization_config"):
        raise UnsupportedModelError("quantized checkpoints (quantization_config) are not supported")
    cfg = dict(cfg)
    # transformers' attribute_map lets a config.json spell the expert count several ways
    experts = next((cfg[k] for k in _EXPERT_ALIASES if cfg.get(k) is not None), None)
    for key in _EXPERT_ALIASES:
        if cfg.get(key) is None and experts is not None:
            cfg[key] = experts
    try:
        return FAMILIES[mt](cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedModelError(f"config.json for {mt!r} is malformed: {type(exc).__name__}: {exc}") from exc
