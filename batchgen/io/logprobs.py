"""OpenAI ``logprobs`` objects from a ``RequestOutput``'s per-token ``{token_id: logprob}``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.outputs import RequestOutput
    from batchgen.tokenizer import Tokenizer


def completion_logprobs(out: RequestOutput, tok: Tokenizer) -> dict[str, Any] | None:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` of ``/v1/completions``."""
    if out.logprobs is None:
        return None
    tokens = [tok.decode([t], skip_special_tokens=False) for t in out.token_ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.get(t) for t, lp in zip(out.token_ids, out.logprobs)],
        "top_logprobs": [{tok.decode([k], skip_special_tokens=False): v for k, v in _top(lp)}
                         for lp in out.logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(out: RequestOutput, tok: Tokenizer) -> dict[str, Any] | None:
    """``{content: [{token, logprob, bytes, top_logprobs}]}`` of ``/v1/chat/completions``."""
    if out.logprobs is None:
        return None
    content = []
    for t, lp in zip(out.token_ids, out.logprobs):
        entry = _entry(tok, t, lp.get(t))
        entry["top_logprobs"] = [_entry(tok, k, v) for k, v in _top(lp)]
        content.append(entry)
    return {"content": content}


def _top(lp: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])


def _entry(tok: Tokenizer, token_id: int, logprob: float | None) -> dict[str, Any]:
    text = tok.decode([token_id], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprob_cell(out: RequestOutput, tok: Tokenizer | None) -> list[dict[str, Any]] | None:
    """One Parquet ``logprobs`` cell: the chat endpoint's ``content`` entries (the JSONL values),
    less ``bytes``: ``list<struct<token, logprob, top_logprobs: list<struct<token, logprob>>>>``."""
    if out.logprobs is None or tok is None:
        return None
    content = (chat_logprobs(out, tok) or {}).get("content", [])
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in content]
