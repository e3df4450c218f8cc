"""tokenizer.json through `tokenizers`; special tokens and the chat template from tokenizer_config.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from .errors import ModelLoadError, RequestError


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
        self.add_bos_token = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids + ([eos_id] if eos_id is not None else [])))
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, model_dir: Path, eos_token_ids: list[int]) -> "Tokenizer | None":
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
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids  # type: ignore[list-item]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise RequestError("messages: this model has no chat_template in tokenizer_config.json; "
                               "send a plain prompt instead")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise RequestError(f"messages: chat template rejected them: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as exc:
            raise RequestError(f"messages: chat template failed: {exc}") from exc
