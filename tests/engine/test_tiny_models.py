"""The oracle fixtures themselves: every tiny checkpoint loads in transformers and means what
the token-exact tests assume it means."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import tiny_models
import torch
from conftest import mixed_prompts
from demo_builder import build_demo_model, corpus
from safetensors import safe_open
from tiny_models import ARCHS, reference_generate, reference_logits, reference_model
from tokenizers import Tokenizer

from batchgen.demo import BOS_ID

ARCH_NAMES = sorted(ARCHS)


def test_tokenizer_round_trips_and_is_deterministic(tokenizer_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert 400 <= tok.get_vocab_size() <= 500
    for text in ["Hello, world!", "  tabs\tand\nnewlines ", "Ünïcödé 😀 ∑", corpus()[3][:500]]:
        ids = tok.encode(text).ids
        assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
        assert tok.decode(ids, skip_special_tokens=True) == text
    again = tiny_models.build_tokenizer(tmp_path)
    assert (again / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


def test_chat_template_in_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    msgs = [{"role": "user", "content": "hi"}]
    # the template starts with bos_token: chat prompts are encoded without special tokens
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        hf.bos_token + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False).endswith("<|im_end|>\n")
    plain_dir = tiny_models.build_tokenizer(tmp_path, chat_template=False)
    plain = json.loads((plain_dir / "tokenizer_config.json").read_text())
    assert "chat_template" not in plain


def test_mixed_prompts(tokenizer_dir: Path, prompt_ids: list[list[int]]) -> None:
    assert [len(p) for p in prompt_ids] == list(tiny_models.PROMPT_LENGTHS)
    assert all(p[0] == BOS_ID for p in prompt_ids)
    assert len({tuple(p[1:6]) for p in prompt_ids if len(p) > 5}) == sum(len(p) > 5 for p in prompt_ids)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert mixed_prompts(tok) == prompt_ids


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_checkpoint_loads_and_is_sharp(arch: str, checkpoint_factory: Callable[..., Path],
                                       prompt_ids: list[list[int]]) -> None:
    ckpt = checkpoint_factory(arch)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (ckpt / name).is_file()
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "rope_parameters" in cfg and "rope_scaling" not in cfg
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    if arch not in ("llama", "llama_tied", "qwen2"):  # per-expert tensors, as real snapshots
        assert any(".experts.0." in n for n in names)

    logits = reference_logits(ckpt, prompt_ids[-1])
    assert torch.isfinite(logits).all()
    # Wide greedy margins: near-ties would make token-exact comparisons flaky.
    top = logits.topk(2, dim=-1).values
    rel_gap = (top[:, 0] - top[:, 1]) / top[:, 0].abs()
    assert (rel_gap > 1e-3).float().mean() > 0.95


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_legacy_rope_keys_load_identically(arch: str, checkpoint_factory: Callable[..., Path],
                                           prompt_ids: list[list[int]]) -> None:
    new, old = checkpoint_factory(arch), checkpoint_factory(arch, legacy_rope_keys=True)
    cfg = json.loads((old / "config.json").read_text())
    assert "rope_parameters" not in cfg and "rope_theta" in cfg and "rope_scaling" in cfg
    assert "torch_dtype" in cfg
    strip = lambda rp: {k: v for k, v in rp.items() if k != "type"}  # noqa: E731
    old_rope, new_rope = (reference_model(d).config.rope_parameters for d in (old, new))
    assert strip(old_rope) == strip(new_rope)
    assert torch.equal(reference_logits(old, prompt_ids[-1]), reference_logits(new, prompt_ids[-1]))


def test_every_parameter_is_randomized(checkpoint_factory: Callable[..., Path]) -> None:
    with safe_open(str(checkpoint_factory("deepseek_v3") / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            assert t.std() > 0.01, name  # no all-ones norm or all-zeros bias left
        assert any(n.endswith("e_score_correction_bias") for n in f.keys())


def test_unused_sliding_window_is_ignored(checkpoint_factory: Callable[..., Path]) -> None:
    cfg = json.loads((checkpoint_factory("qwen2") / "config.json").read_text())
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] == tiny_models.UNUSED_SLIDING_WINDOW
    assert reference_model(checkpoint_factory("qwen2")).config.sliding_window is None


def test_mixtral_sliding_window_matters(checkpoint_factory: Callable[..., Path], prompt_ids: list[list[int]],
                                        tmp_path: Path) -> None:
    prompt = prompt_ids[-1]
    window = reference_model(checkpoint_factory("mixtral")).config.sliding_window
    assert window is not None and window < len(prompt)
    full = tiny_models.build_checkpoint("mixtral", tmp_path, sliding_window=None)
    a, b = reference_logits(checkpoint_factory("mixtral"), prompt), reference_logits(full, prompt)
    assert torch.equal(a[:window], b[:window])
    assert not torch.allclose(a[window:], b[window:])


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "qwen2_moe"])
def test_reference_generate_matches_stepwise_argmax(arch: str, checkpoint_factory: Callable[..., Path],
                                                    prompt_ids: list[list[int]]) -> None:
    ckpt, prompt, n = checkpoint_factory(arch), prompt_ids[-3], 12  # 64 + 12 > mixtral's window
    model = reference_model(ckpt)
    ids, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(n):  # no KV cache: recompute everything each step
            expected.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            ids.append(expected[-1])
    got = reference_generate(ckpt, prompt, n, ignore_eos=True)
    assert got == expected
    stops = set(tiny_models.GENERATION_EOS)
    first_stop = next((i for i, t in enumerate(expected) if t in stops), None)
    until_stop = reference_generate(ckpt, prompt, n)
    assert until_stop == (expected if first_stop is None else expected[: first_stop + 1])


def test_demo_model_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    kw = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4,
              intermediate_size=64, vocab_size=300)
    path = build_demo_model(tmp_path / "demo", **kw)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and "rope_theta" in cfg
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in f.keys()
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([mixed_prompts(path, (50,))[0]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.5

    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert build_demo_model(path, **kw) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # same seed: not rebuilt
    before = (path / "model.safetensors").read_bytes()
    build_demo_model(path, seed=1, **kw)
    assert (path / "model.safetensors").read_bytes() != before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        build_demo_model(tmp_path / "other", **kw)
