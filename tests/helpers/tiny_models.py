"""Tiny random Hugging Face checkpoints: the oracle fixtures for token-exact tests.

Each architecture is built by transformers itself (so the weights, names and config are what a
real snapshot has), with random norm weights, biases and router biases so that every parameter
changes the output, and a high initializer_range so greedy argmax margins are wide.
`reference_generate` is the oracle: transformers' own greedy generate, one prompt at a time.
"""
from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from demo_builder import corpus, tokenizer_vocab_size, train_tokenizer
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from batchgen.demo import BOS_ID, EOS_ID, IM_END_ID, PAD_ID

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

TOKENIZER_VOCAB = 480
MAX_POS = 512
INIT_RANGE = 0.2
# A chat model's generation_config stops on either token (as Qwen's and Llama 3's do).
GENERATION_EOS = [EOS_ID, IM_END_ID]
# Written into config.json where use_sliding_window is false (real Qwen snapshots carry a
# window they do not use); small enough to change outputs if a loader wrongly applies it.
UNUSED_SLIDING_WINDOW = 64
PROMPT_LENGTHS = (1, 2, 5, 13, 31, 64, 127, 200)

_SPECIALS = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


def _common(vocab: int, **kw: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
        initializer_range=INIT_RANGE, rms_norm_eps=1e-6, tie_word_embeddings=False, **_SPECIALS,
    )
    return base | kw


def _yarn(theta: float, **kw: Any) -> dict[str, Any]:
    return dict(rope_type="yarn", rope_theta=theta, factor=4.0, original_max_position_embeddings=128, **kw)


def llama(vocab: int, **o: Any) -> PreTrainedConfig:
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=128)
    return LlamaConfig(**_common(vocab, rope_parameters=rope, attention_bias=False) | o)


def llama_tied(vocab: int, **o: Any) -> PreTrainedConfig:
    rope = dict(rope_type="linear", rope_theta=10000.0, factor=2.0)
    kw = _common(vocab, num_key_value_heads=4, tie_word_embeddings=True, rope_parameters=rope)
    return LlamaConfig(**kw | o)


def qwen2(vocab: int, **o: Any) -> PreTrainedConfig:
    # Vocab padded past the tokenizer's, as Qwen's is (151936 rows for 151665 tokens).
    return Qwen2Config(**_common(vocab + 16, rope_parameters=_yarn(1e6), use_sliding_window=False,
                                 max_window_layers=2) | o)


def mixtral(vocab: int, **o: Any) -> PreTrainedConfig:
    kw = _common(vocab, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                 sliding_window=64, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    return MixtralConfig(**kw | o)


def qwen2_moe(vocab: int, **o: Any) -> PreTrainedConfig:
    # decoder_sparse_step=2 -> layers 1, 3, 5 are MoE; mlp_only_layers removes 3 -> MoE {1, 5}.
    kw = _common(vocab, num_hidden_layers=6, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                 num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2,
                 mlp_only_layers=[3], use_sliding_window=False, qkv_bias=True,
                 rope_parameters=dict(rope_type="default", rope_theta=1e6))
    return Qwen2MoeConfig(**kw | o)


def qwen3_moe(vocab: int, **o: Any) -> PreTrainedConfig:
    # head_dim 32 != 64 / 4; MoE on layers {0, 1, 3}.
    kw = _common(vocab, num_hidden_layers=4, head_dim=32, moe_intermediate_size=48, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2],
                 use_sliding_window=False, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    return Qwen3MoeConfig(**kw | o)


def olmoe(vocab: int, **o: Any) -> PreTrainedConfig:
    kw = _common(vocab, intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                 clip_qkv=2.0, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    return OlmoeConfig(**kw | o)


def _mla(vocab: int, **kw: Any) -> dict[str, Any]:
    return _common(vocab, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                   v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8, first_k_dense_replace=1,
                   n_group=4, topk_group=2, **kw)


def deepseek_v2(vocab: int, **o: Any) -> PreTrainedConfig:
    # mscale != mscale_all_dim, so both the cos/sin factor and the softmax-scale factor are != 1.
    kw = _mla(vocab, q_lora_rank=None, num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=1.7,
              topk_method="group_limited_greedy", norm_topk_prob=False,
              rope_parameters=_yarn(10000.0, mscale=1.0, mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
              scoring_func="softmax", moe_layer_freq=1)  # last two: real-config keys transformers ignores
    return DeepseekV2Config(**kw | o)


def deepseek_v3(vocab: int, **o: Any) -> PreTrainedConfig:
    kw = _mla(vocab, q_lora_rank=24, num_experts_per_tok=3, n_shared_experts=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, rope_interleave=True,
              rope_parameters=_yarn(10000.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
              topk_method="noaux_tc", scoring_func="sigmoid")  # last two: ignored, sigmoid is hard-coded
    return DeepseekV3Config(**kw | o)


ARCHS: dict[str, Callable[..., PreTrainedConfig]] = {
    f.__name__: f
    for f in (llama, llama_tied, qwen2, mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3)
}


def build_tokenizer(path: str | os.PathLike, chat_template: bool = True) -> Path:
    """Write the shared tiny tokenizer (byte-level BPE, ~480 ids, ids 0-4 special) into `path`."""
    return train_tokenizer(path, vocab_size=TOKENIZER_VOCAB, chat_template=chat_template,
                           model_max_length=MAX_POS)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF initialises norms to 1 and biases to 0; a reimplementation that skipped one would
    # still agree. Random values make every parameter (and DeepSeek's router bias) count.
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if "norm" in name:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.2)


def _to_legacy_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers 4.x snapshots have it: rope_theta + rope_scaling, torch_dtype."""
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    # Llama 3.1 snapshots say "rope_type"; Qwen, DeepSeek and Llama 2 era ones say "type".
    key = "rope_type" if kind == "llama3" else "type"
    cfg["rope_scaling"] = None if kind == "default" else {key: kind} | rope
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    if cfg["model_type"].startswith("deepseek"):
        for derived in ("head_dim", "qk_head_dim"):  # recomputed from the qk_* dims on load
            cfg.pop(derived, None)
    if set(cfg.get("layer_types") or ["x"]) == {"full_attention"}:
        del cfg["layer_types"]
    return cfg


def build_checkpoint(arch: str, path: str | os.PathLike, legacy_rope_keys: bool = False, *,
                     seed: int = 0, **overrides: Any) -> Path:
    """Build a tiny random `arch` checkpoint (safetensors, config, generation_config, tokenizer)
    in `path` and return it. `overrides` go to the config class."""
    path = Path(path)
    build_tokenizer(path)
    config = ARCHS[arch](tokenizer_vocab_size(path), **overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(path)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": GENERATION_EOS, "pad_token_id": PAD_ID}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("use_sliding_window") is False and "sliding_window" not in overrides:
        cfg["sliding_window"] = UNUSED_SLIDING_WINDOW
    if legacy_rope_keys:
        cfg = _to_legacy_config(cfg)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


@functools.cache
def _load(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def reference_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model for `model_dir`, in `dtype` on CPU, loaded once per process."""
    return _load(str(Path(model_dir).resolve()), dtype)


@torch.no_grad()
def reference_logits(model_dir: str | os.PathLike, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, V] of one unpadded prompt, by transformers."""
    return reference_model(model_dir)(torch.tensor([list(prompt_ids)])).logits[0]


@torch.no_grad()
def reference_generate(model_dir: str | os.PathLike, prompt_ids: list[int], max_new_tokens: int,
                       ignore_eos: bool = False, dtype: torch.dtype = torch.float32) -> list[int]:
    """Greedy tokens transformers generates for one prompt alone (no batch, no padding).

    The generated ids come back without the prompt; a stop token ends the list and is
    included in it. With `ignore_eos`, stop tokens are generated like any other (vLLM's
    ignore_eos: not suppressed, just not stopping) and exactly `max_new_tokens` come back. The
    model runs in `dtype` (float32: the engines' parity oracle)."""
    model = reference_model(model_dir, dtype)
    gen = copy.deepcopy(model.generation_config)  # from generation_config.json
    gen.update(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
    if ignore_eos:
        gen.eos_token_id = []  # None would mean "unset" and fall back to generation_config.json
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0, len(prompt_ids):].tolist()


def mixed_prompts(tokenizer: Any, lengths: Sequence[int] = PROMPT_LENGTHS) -> list[list[int]]:
    """Deterministic prompts of the given token lengths (BOS first), cut from pydoc text.

    `tokenizer`: a directory with tokenizer.json, a `tokenizers.Tokenizer`, or anything whose
    `encode(text, add_special_tokens=False)` returns ids (or an object with `.ids`)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    text = "\n\n".join(corpus()[:40])
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids = list(getattr(enc, "ids", enc))
    stride = max(lengths) + 37  # prompts come from different places, not one prefix
    if len(ids) < stride * len(lengths):
        raise ValueError(f"pydoc text gives only {len(ids)} tokens")
    return [[BOS_ID] + ids[i * stride : i * stride + n - 1] for i, n in enumerate(lengths)]


# Qwen3's switch, in the shape of its template: thinking off writes an empty think block; a role
# the template does not know raises, as Qwen's does
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")


def build_thinking_checkpoint(path: str | os.PathLike) -> Path:
    """A tiny Qwen3-MoE checkpoint whose chat template honours `enable_thinking`."""
    out = build_checkpoint("qwen3_moe", path)
    cfg_path = out / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": THINKING_TEMPLATE}, indent=2))
    return out
