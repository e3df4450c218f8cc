"""Model directory (config.json + *.safetensors) -> ModelSpec + ModelWeights.

Checkpoints are read lazily tensor by tensor through safetensors' memory map; expert weights are
stacked [E, ...] on load. Both the per-expert layout of downloaded snapshots and the fused
`experts.gate_up_proj` layout are accepted.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import ModelLoadError
from .families import parse_config
from .spec import GQASpec, MLASpec, ModelSpec, MoESpec
from .weights import GQAWeights, LayerWeights, MLAWeights, MLPWeights, ModelWeights, MoEWeights


def read_config(model_dir: Path) -> dict[str, Any]:
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist or is not a directory")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"model directory {str(model_dir)!r} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return cfg


class _TensorSource:
    """name -> tensor over all safetensors shards of a directory."""

    def __init__(self, model_dir: Path, stack: ExitStack, private: bool = False) -> None:
        self.private = private
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"model directory {str(model_dir)!r} has no *.safetensors weights")
        self._where: dict[str, Any] = {}
        for f in files:
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read weights file {f.name}: {exc}") from exc
            for name in handle.keys():
                self._where[name] = handle

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"weights lack tensor {name!r}")
        tensor = self._where[name].get_tensor(name)
        if tensor.dtype != dtype:
            return tensor.to(dtype)
        # safetensors hands out views of its memory map (clean pages shared between processes);
        # a private copy keeps an engine that reads the file during the job (experts on disk)
        # safe from the file changing under it: a truncated mapped file raises SIGBUS
        return tensor.clone() if self.private else tensor

    def maybe(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        return self.get(name, dtype) if name in self._where else None


def _mlp(src: _TensorSource, prefix: str, names: tuple[str, str, str], dt: torch.dtype) -> MLPWeights:
    g, u, d = names
    gb, ub = src.maybe(f"{prefix}.{g}.bias", dt), src.maybe(f"{prefix}.{u}.bias", dt)
    return MLPWeights(
        gate_up=torch.cat([src.get(f"{prefix}.{g}.weight", dt), src.get(f"{prefix}.{u}.weight", dt)]),
        down=src.get(f"{prefix}.{d}.weight", dt),
        gate_up_bias=torch.cat([gb, ub]) if gb is not None and ub is not None else None,
        down_bias=src.maybe(f"{prefix}.{d}.bias", dt),
    )


def _moe(src: _TensorSource, spec: ModelSpec, ffn: MoESpec, prefix: str, dt: torch.dtype,
         routed_experts: bool = True) -> MoEWeights:
    E = ffn.router.num_experts
    g, u, d = spec.expert_names
    w13 = w2 = None
    if not routed_experts:
        pass  # left on disk: the expert store (batchgen/offload) reads them one at a time
    elif src.has(f"{prefix}.experts.gate_up_proj"):
        w13, w2 = src.get(f"{prefix}.experts.gate_up_proj", dt), src.get(f"{prefix}.experts.down_proj", dt)
    else:
        w13 = torch.stack([torch.cat([src.get(f"{prefix}.experts.{e}.{g}.weight", dt),
                                      src.get(f"{prefix}.experts.{e}.{u}.weight", dt)]) for e in range(E)])
        w2 = torch.stack([src.get(f"{prefix}.experts.{e}.{d}.weight", dt) for e in range(E)])
    shared = None
    if ffn.shared_intermediate_size:
        name = "shared_expert" if src.has(f"{prefix}.shared_expert.gate_proj.weight") else "shared_experts"
        shared = _mlp(src, f"{prefix}.{name}", ("gate_proj", "up_proj", "down_proj"), dt)
    return MoEWeights(
        router=src.get(f"{prefix}.gate.weight", torch.float32),
        w13=w13.contiguous() if w13 is not None else None, w2=w2.contiguous() if w2 is not None else None,
        correction_bias=src.get(f"{prefix}.gate.e_score_correction_bias", torch.float32)
        if ffn.router.has_correction_bias else None,
        shared=shared,
        shared_gate=src.get(f"{prefix}.shared_expert_gate.weight", dt) if ffn.shared_gate else None,
    )


def _gqa(src: _TensorSource, p: str, a: GQASpec, dt: torch.dtype) -> GQAWeights:
    qkv_bias = None
    if a.qkv_bias:
        qkv_bias = torch.cat([src.get(f"{p}.{n}_proj.bias", dt) for n in "qkv"])
    return GQAWeights(
        qkv=torch.cat([src.get(f"{p}.{n}_proj.weight", dt) for n in "qkv"]),
        o=src.get(f"{p}.o_proj.weight", dt),
        qkv_bias=qkv_bias,
        o_bias=src.get(f"{p}.o_proj.bias", dt) if a.o_bias else None,
        q_norm=src.get(f"{p}.q_norm.weight", dt) if a.qk_norm != "none" else None,
        k_norm=src.get(f"{p}.k_norm.weight", dt) if a.qk_norm != "none" else None,
    )


def _mla(src: _TensorSource, p: str, a: MLASpec, dt: torch.dtype) -> MLAWeights:
    lora = a.q_lora_rank is not None
    return MLAWeights(
        kv_a=src.get(f"{p}.kv_a_proj_with_mqa.weight", dt),
        kv_a_norm=src.get(f"{p}.kv_a_layernorm.weight", dt),
        kv_b=src.get(f"{p}.kv_b_proj.weight", dt),
        o=src.get(f"{p}.o_proj.weight", dt),
        q=None if lora else src.get(f"{p}.q_proj.weight", dt),
        q_a=src.get(f"{p}.q_a_proj.weight", dt) if lora else None,
        q_a_norm=src.get(f"{p}.q_a_layernorm.weight", dt) if lora else None,
        q_b=src.get(f"{p}.q_b_proj.weight", dt) if lora else None,
        kv_a_bias=src.maybe(f"{p}.kv_a_proj_with_mqa.bias", dt) if a.attention_bias else None,
        q_a_bias=src.maybe(f"{p}.q_a_proj.bias", dt) if a.attention_bias and lora else None,
        o_bias=src.maybe(f"{p}.o_proj.bias", dt) if a.attention_bias else None,
    )


def load_weights(model_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 routed_experts: bool = True) -> ModelWeights:
    """routed_experts False: MoE layers' routed experts are not read (w13/w2 None) and the rest
    is copied out of the memory map (the expert store reads the same files during the job)."""
    with ExitStack() as stack:
        src = _TensorSource(model_dir, stack, private=not routed_experts)
        embed = src.get("model.embed_tokens.weight", dtype)
        if embed.shape[0] != spec.vocab_size or embed.shape[1] != spec.hidden_size:
            raise ModelLoadError(f"model.embed_tokens.weight has shape {tuple(embed.shape)}, config.json says "
                                 f"[{spec.vocab_size}, {spec.hidden_size}]")
        if spec.tie_word_embeddings or not src.has("lm_head.weight"):
            if not spec.tie_word_embeddings:
                raise ModelLoadError("weights lack tensor 'lm_head.weight' and tie_word_embeddings is false")
            lm_head = embed
        else:
            lm_head = src.get("lm_head.weight", dtype)
        layers = []
        for i, ls in enumerate(spec.layers):
            p = f"model.layers.{i}"
            a = ls.attention
            attn = _gqa(src, f"{p}.self_attn", a, dtype) if isinstance(a, GQASpec) else _mla(src, f"{p}.self_attn", a, dtype)
            if isinstance(ls.ffn, MoESpec):
                ffn: MLPWeights | MoEWeights = _moe(src, spec, ls.ffn, f"{p}.{spec.ffn_prefix}", dtype, routed_experts)
            else:
                ffn = _mlp(src, f"{p}.mlp", ("gate_proj", "up_proj", "down_proj"), dtype)
            layers.append(LayerWeights(src.get(f"{p}.input_layernorm.weight", dtype),
                                       src.get(f"{p}.post_attention_layernorm.weight", dtype), attn, ffn))
        weights = ModelWeights(embed=embed, norm=src.get("model.norm.weight", dtype), lm_head=lm_head, layers=layers)
    return to_device(weights, device) if device.type != "cpu" else weights


def to_device(obj: Any, device: torch.device, moved: dict[int, torch.Tensor] | None = None) -> Any:
    """Move every tensor once: a tensor shared by two fields (tied embeddings) stays shared."""
    moved = {} if moved is None else moved
    if isinstance(obj, torch.Tensor):
        if id(obj) not in moved:
            moved[id(obj)] = obj.to(device)
        return moved[id(obj)]
    if isinstance(obj, list):
        return [to_device(x, device, moved) for x in obj]
    if hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            setattr(obj, name, to_device(getattr(obj, name), device, moved))
    return obj


def load_spec(model_dir: Path) -> tuple[dict[str, Any], ModelSpec]:
    cfg = read_config(model_dir)
    return cfg, parse_config(cfg)


def generation_eos_ids(model_dir: Path, config_eos: tuple[int, ...]) -> list[int]:
    """Stop ids: config.json's eos_token_id plus generation_config.json's (chat models list several)."""
    ids = list(config_eos)
    path = model_dir / "generation_config.json"
    if path.is_file():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        ids += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
    return list(dict.fromkeys(ids))
