"""Random-weight demo-layout checkpoints for tests and benchmarks: a small Mixtral-style MoE
written in Hugging Face's layout, and the byte-level BPE tokenizer trainer the tiny fixtures share.

Nothing here imports transformers: the checkpoint is written by hand with the exact file names,
config keys and tensor names a downloaded Mixtral snapshot has, so a test exercises the same
loading path as a real model. The weights are random: the text is gibberish, the speed is real.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchgen.demo.tokens import BOS_ID, CHAT_TEMPLATE, EOS_ID, PAD_ID, SPECIAL_TOKENS

_MARKER = ".batchgen-demo.json"
_MARKER_VERSION = 1


def corpus() -> list[str]:
    """Training text that ships with CPython (pydoc's help topics), in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    # Cached: the test fixtures write the same tokenizer into many checkpoint dirs.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0..4, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    # BOS comes from the post-processor, as in Llama-style tokenizer.json files.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok.to_str()


def train_tokenizer(
    path: str | os.PathLike,
    *,
    vocab_size: int = 1000,
    chat_template: bool = True,
    model_max_length: int = 4096,
) -> Path:
    """Train a deterministic byte-level BPE on `corpus()` and write tokenizer.json and
    tokenizer_config.json into `path` (created if missing). Returns `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_trained_tokenizer_json(vocab_size), encoding="utf-8")
    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def tokenizer_vocab_size(path: str | os.PathLike) -> int:
    """Number of ids the tokenizer in `path` can produce, special tokens included."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def _demo_weights(
    gen: torch.Generator, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
    experts: int, inter: int,
) -> dict[str, torch.Tensor]:
    head_dim = hidden // heads

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    # std 1/sqrt(fan_in) keeps each projection's output at the input's scale; the two
    # projections that write the residual stream are shrunk so 4 layers do not blow it up.
    res = (2 * layers) ** -0.5
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + normal(hidden, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + normal(hidden, std=0.1)
        w[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden, std=hidden**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, std=hidden**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, std=hidden**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, hidden, std=res * hidden**-0.5)
        w[p + "block_sparse_moe.gate.weight"] = normal(experts, hidden, std=hidden**-0.5)
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            w[q + "w1.weight"] = normal(inter, hidden, std=hidden**-0.5)  # gate
            w[q + "w3.weight"] = normal(inter, hidden, std=hidden**-0.5)  # up
            w[q + "w2.weight"] = normal(hidden, inter, std=res * inter**-0.5)  # down
    w["model.norm.weight"] = 1.0 + normal(hidden, std=0.1)
    # Logits with std ~3 give clear greedy winners, still sampleable at temperature 1.
    w["lm_head.weight"] = normal(vocab, hidden, std=3.0 * hidden**-0.5)
    return w


def build_demo_model(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    overwrite: bool = False,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    num_experts: int = 16,
    top_k: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 1000,
    max_position_embeddings: int = 4096,
    dtype: str = "bfloat16",
) -> Path:
    """Write a random Mixtral-style MoE checkpoint (config.json, model.safetensors,
    generation_config.json, tokenizer files) into `path` and return it.

    A directory that already holds a demo model built with the same arguments is left as is
    (unless `overwrite`); a non-empty directory that is not a demo model raises FileExistsError.
    """
    path = Path(path)
    params = dict(
        seed=seed, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, num_experts=num_experts, top_k=top_k,
        intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, dtype=dtype,
    )
    marker = {"version": _MARKER_VERSION, **params}
    marker_path = path / _MARKER
    if path.is_dir() and not overwrite:
        if marker_path.is_file():
            if json.loads(marker_path.read_text()) == marker:
                return path
        elif any(path.iterdir()):
            raise FileExistsError(f"{path} is not empty and holds no batchgen demo model (overwrite=True)")
    if hidden_size % num_heads or num_heads % num_kv_heads or top_k > num_experts:
        raise ValueError(
            f"bad demo shape: hidden_size={hidden_size}, num_heads={num_heads}, "
            f"num_kv_heads={num_kv_heads}, top_k={top_k}, num_experts={num_experts}"
        )

    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then move files in with the marker last, so a reader that
    # sees the marker sees a whole model even if two processes build at once.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        train_tokenizer(tmp, vocab_size=vocab_size, model_max_length=max_position_embeddings)
        vocab = tokenizer_vocab_size(tmp)
        gen = torch.Generator().manual_seed(seed)
        weights = _demo_weights(
            gen, vocab=vocab, hidden=hidden_size, layers=num_layers, heads=num_heads,
            kv_heads=num_kv_heads, experts=num_experts, inter=intermediate_size,
        )
        torch_dtype = getattr(torch, dtype)
        weights = {k: v.to(torch_dtype).contiguous() for k, v in weights.items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": vocab,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": max_position_embeddings,
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-5,
            "use_cache": True,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": None,
            "tie_word_embeddings": False,
            "rope_theta": 1e6,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "num_experts_per_tok": top_k,
            "num_local_experts": num_experts,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.02,
            "router_jitter_noise": 0.0,
            "torch_dtype": dtype,
        }
        generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
        for name, obj in (("config.json", config), ("generation_config.json", generation)):
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")

        path.mkdir(exist_ok=True)
        marker_path.unlink(missing_ok=True)
        for name in sorted(os.listdir(tmp), key=lambda n: n == _MARKER):
            os.chmod(tmp / name, 0o644)  # safetensors writes 0600; the cache may be shared
            os.replace(tmp / name, path / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
