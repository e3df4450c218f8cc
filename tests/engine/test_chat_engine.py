"""Engine.chat (vLLM's LLM.chat) on a Qwen3-MoE-shaped tiny checkpoint whose chat template
honours `enable_thinking`, as Qwen3's does; transformers' apply_chat_template is the oracle."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_models import build_thinking_checkpoint, reference_generate
from transformers import AutoTokenizer

from batchgen import Engine, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "alpha beta gamma"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three four"}],
]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
OPTIONS = {"kv_cache_bytes": 16 << 20}


def oracle_ids(model: Path, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(model))
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_checkpoint(tmp_path_factory.mktemp("qwen3-thinking"))


@pytest.fixture(scope="module")
def engine(qwen3: Path) -> Engine:
    return Engine(qwen3, **OPTIONS)


def test_chat_equals_generate_on_the_rendered_prompts(engine: Engine, qwen3: Path) -> None:
    off = {"enable_thinking": False}
    rendered = [oracle_ids(qwen3, c, **off) for c in CONVERSATIONS]
    assert rendered != [oracle_ids(qwen3, c) for c in CONVERSATIONS]  # the switch changes the prompt
    chats = engine.chat(CONVERSATIONS, GREEDY, chat_template_kwargs=off)
    plain = engine.generate(rendered, GREEDY)
    assert [o.prompt_token_ids for o in chats] == rendered
    assert [o.token_ids for o in chats] == [o.token_ids for o in plain]
    assert chats[0].token_ids == reference_generate(qwen3, rendered[0], 6, ignore_eos=True)


def test_one_conversation_and_per_request_params(engine: Engine, qwen3: Path) -> None:
    one = engine.chat(CONVERSATIONS[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(one) == 1 and one[0].prompt_token_ids == oracle_ids(qwen3, CONVERSATIONS[1])
    assert one[0].num_generated_tokens == 3
    many = engine.chat(CONVERSATIONS[:2], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                           for n in (2, 4)])
    assert [o.num_generated_tokens for o in many] == [2, 4]


def test_a_malformed_conversation_fails_alone(engine: Engine) -> None:
    bad: list[Any] = ["not a list", [], [{"content": "no role"}], [{"role": "tool", "content": "x"}],
                      [{"role": "user"}], [{"role": "user", "content": 3}]]
    outs = engine.chat([CONVERSATIONS[0], *bad], GREEDY)
    assert outs[0].finish_reason == "length" and outs[0].error is None
    assert [o.finish_reason for o in outs[1:]] == ["error"] * len(bad)
    errors = [o.error or "" for o in outs[1:]]
    assert errors[0].startswith("messages must be a non-empty list") and "'not a list'" in errors[0]
    assert errors[1].startswith("messages must be a non-empty list")
    assert errors[2].startswith("messages[0] must be an object with a string 'role'")
    assert "unknown role tool" in errors[3]
    assert errors[4].startswith("messages[0].content must be a string")
    assert errors[5].startswith("messages[0].content") and "3" in errors[5]


def test_chat_template_kwargs_must_be_an_object(engine: Engine) -> None:
    outs = engine.chat([CONVERSATIONS[0]], GREEDY, chat_template_kwargs=["enable_thinking"])  # type: ignore[arg-type]
    assert outs[0].finish_reason == "error" and "chat_template_kwargs must be an object" in (outs[0].error or "")
