"""Tokenizer and chat template rendering agree with transformers (the oracle)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models
from transformers import AutoTokenizer

from batchgen.errors import RequestError
from batchgen.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief & kind: é"},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "List three fruits"}]

# Exercises what real templates use: loop controls, tojson, strftime_now, generation blocks.
FANCY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content | tojson }}"
    "{% continue %}{% endif %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% if loop.index > 5 %}{% break %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ strftime_now('%Y') | length }}"
)


@pytest.fixture(scope="module")
def model_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


def test_encode_and_decode_match_transformers(model_dir: Path) -> None:
    ours = Tokenizer.from_dir(model_dir, [])
    theirs = AutoTokenizer.from_pretrained(model_dir)
    for text in ["The quick brown fox", "  spaces\tand\nnewlines ", "def f(x):\n    return x"]:
        assert ours.encode(text) == theirs(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("template", [None, FANCY_TEMPLATE], ids=["model-template", "fancy-template"])
def test_chat_template_matches_transformers(model_dir: Path, tmp_path: Path, template: str | None) -> None:
    target = tmp_path / "m"
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((model_dir / name).read_bytes())
    if template is not None:
        cfg = json.loads((target / "tokenizer_config.json").read_text())
        (target / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": template}))
    ours = Tokenizer.from_dir(target, [])
    theirs = AutoTokenizer.from_pretrained(target)
    for gen in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == \
            theirs.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)


def test_no_chat_template_is_a_request_error(tmp_path: Path) -> None:
    tiny_models.build_tokenizer(tmp_path, chat_template=False)
    tok = Tokenizer.from_dir(tmp_path, [])
    with pytest.raises(RequestError, match="no chat_template"):
        tok.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json_means_token_ids_only(tmp_path: Path) -> None:
    assert Tokenizer.from_dir(tmp_path, []) is None


def test_incremental_decode_equals_full_decode(model_dir: Path) -> None:
    """Token by token, decode_new's pieces add up to the full decode, for random id streams
    (which include byte tokens that split UTF-8 characters)."""
    import random

    tok = Tokenizer.from_dir(model_dir, [])
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        text, offsets = "", (0, 0)
        for n in range(1, len(ids) + 1):
            new, prefix, read = tok.decode_new(ids[:n], *offsets)
            offsets = (max(prefix, read - 6), read)
            text += new
        full = tok.decode(ids)
        # equal, except while the newest bytes are an incomplete character (held back)
        assert text == full or (full.endswith("\ufffd") and full.startswith(text)), (text, full)
