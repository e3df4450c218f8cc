"""tokenizer.json through `tokenizers`; special tokens and the chat template from tokenizer_config.json.

Chat messages are checked and rendered here, once for every front end (batch files, DataFrames,
`Engine.chat`), so a conversation becomes the same token ids whichever way it arrives.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes
from tokenizers import Tokenizer as HFTokenizer

from .errors import ModelLoadError, RequestError


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers' templates; for inference it just renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes and sorts keys; templates expect plain json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_env() -> jinja2.Environment:
    """The environment transformers renders chat templates in (same extensions and helpers)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson

    def raise_exception(message: str) -> None:
        raise RequestError(f"messages: chat template rejected them: {message}")

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    """tokenizer_config spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], eos_token_ids: list[int],
                 chat_template: str | None) -> None:
        self._tok = tokenizer
        self.config = config
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids + ([eos_id] if eos_id is not None else [])))
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            self._compiled = _template_env().from_string(self.chat_template)
        return self._compiled

    @classmethod
    def from_dir(cls, model_dir: Path, eos_token_ids: list[int]) -> Tokenizer | None:
        """None when the directory has no tokenizer.json (token-id prompts still work)."""
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tok = HFTokenizer.from_file(str(path))
            cfg_path = model_dir / "tokenizer_config.json"
            config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ModelLoadError(f"cannot read the tokenizer in {str(model_dir)!r}: {exc}") from exc
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(tok, config, eos_token_ids, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """tokenizer.json's post-processor decides about BOS/EOS, as in transformers 5."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def to_json(self) -> str:
        """tokenizer.json's text (structured outputs hand it to the grammar library)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_new(self, ids: list[int], prefix_offset: int, read_offset: int) -> tuple[str, int, int]:
        """Text that ids[read_offset:] add after ids[:read_offset] -> (text, prefix, read offsets).

        Decodes only from prefix_offset (a few tokens back, so merges and leading spaces come
        out as in a full decode) instead of the whole output each token. While the newest bytes
        form an incomplete UTF-8 character, nothing is emitted and the offsets stay.
        """
        known = self.decode(ids[prefix_offset:read_offset])
        full = self.decode(ids[prefix_offset:])
        if len(full) > len(known) and not full.endswith("\ufffd"):
            return full[len(known):], read_offset, len(ids)
        return "", prefix_offset, read_offset

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **chat_template_kwargs: Any) -> str:
        """chat_template_kwargs: extra template variables (Qwen3's `enable_thinking`), as
        transformers' and vLLM's `chat_template_kwargs`; they override the special tokens."""
        if not self.chat_template:
            raise RequestError("messages: this model has no chat_template in tokenizer_config.json; "
                               "send a plain prompt instead")
        specials = {k: _token_text(v) or "" for k, v in self.config.items() if k.endswith("_token")}
        variables = {**specials, **chat_template_kwargs, "messages": messages,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template().render(**variables)
        except RequestError:
            raise
        except jinja2.TemplateError as exc:
            raise RequestError(f"messages: chat template failed: {exc}") from exc

    def chat_ids(self, chat: ChatPrompt) -> list[int]:
        """A conversation's prompt token ids: checked, rendered by the chat template, then encoded
        without special tokens (the template writes them). RequestError names the bad field."""
        check_chat(chat)
        flat = [{**m, "content": _flatten(m.get("content"))} for m in chat.messages]
        try:
            text = self.apply_chat_template(flat, chat.add_generation_prompt, **(chat.chat_template_kwargs or {}))
        except RequestError:
            raise
        except Exception as exc:  # user data through the model's template: any failure is this row's
            raise RequestError(f"messages: chat template failed: {exc}") from exc
        return self.encode(text, add_special_tokens=False)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """One conversation as a prompt: rendered by the model's chat template where it is admitted
    (the engine that runs it), so it travels as plain data."""

    messages: list[Any]
    add_generation_prompt: bool = True
    chat_template_kwargs: Mapping[str, Any] | None = field(default=None)


def check_chat(chat: ChatPrompt) -> None:
    """RequestError naming the field and the value of what no template could render."""
    problem = message_problem(chat.messages)
    if problem:
        raise RequestError(problem)
    kwargs = chat.chat_template_kwargs
    if kwargs is not None and (not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)):
        raise RequestError(f"chat_template_kwargs must be an object with string keys, got {_show(kwargs)}")
    if not isinstance(chat.add_generation_prompt, bool):
        raise RequestError(f"add_generation_prompt must be true or false, got {_show(chat.add_generation_prompt)}")


def message_problem(messages: Any) -> str | None:
    """What is wrong with a list of chat messages (None: nothing), naming the message and field."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return f"messages must be a non-empty list of messages, got {_show(messages)}"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string 'role', got {_show(m)}"
        content = m.get("content")
        if content is None and m["role"] != "assistant":  # only an assistant turn (tool calls) may omit it
            return f"messages[{i}].content must be a string or a list of text parts, got null"
        if not (content is None or isinstance(content, str) or _is_text_parts(content)):
            return f"messages[{i}].content must be a string or a list of text parts, got {_show(content)}"
    return None


def _flatten(content: Any) -> Any:
    # Text parts become one string, as vLLM does for templates that expect a string.
    return "".join(p["text"] for p in content) if isinstance(content, (list, tuple)) else content


def _is_text_parts(content: Any) -> bool:
    return isinstance(content, (list, tuple)) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content)


def _show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
