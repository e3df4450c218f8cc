"""The request model shared by the input formats: one parsed input row.

A row is either runnable (``prompt_token_ids`` and ``params`` set) or carries a ``RowError``
that is written to the output in its place. Either way it has a ``key``: what ``--resume`` uses
to recognise the row as already done.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.sampling_params import SamplingParams

# JSONL: ("id", custom_id) for a row with a usable custom_id, else ("line", line_no).
# Parquet: the 0-based row number.
RowKey = Hashable
NO_VALUE: Any = object()  # "the field is absent", as opposed to a null value


@dataclass(frozen=True, slots=True)
class RowError:
    """Why one input row cannot run. ``message`` names the row, the field and the value."""

    code: str
    message: str
    param: str | None = None


@dataclass(slots=True)
class Request:
    """One input row after parsing and validation.

    ``where`` is how messages name the row ("line 7", "row 12"); ``number`` is that line (JSONL,
    1-based) or row (Parquet, 0-based) number.
    """

    key: RowKey
    where: str
    number: int
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    error: RowError | None = None
    custom_id: str | None = None  # JSONL only
    chat: bool = False  # the prompt is chat messages, rendered by the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # the template's extra variables (chat rows)
    columns: dict[str, Any] = field(default_factory=dict)  # Parquet: the row's input columns
    model: str | None = None  # multi-model jobs: the name of the model this row runs on

    @property
    def is_valid(self) -> bool:
        return self.error is None

    def fail(self, code: str, reason: str, param: str | None = None,
             value: Any = NO_VALUE) -> Request:
        """Mark the row invalid. The message reads ``line 7: body.top_p=7: must be in (0, 1]``;
        with no value given ``line 7: body: missing``."""
        return self.fail_with(RowError(code, describe(reason, param, value), param))

    def fail_with(self, error: RowError) -> Request:
        """``error.message`` is prefixed with where the row is."""
        self.error = RowError(error.code, f"{self.where}: {error.message}", error.param)
        self.params = None
        self.prompt_token_ids = None
        self.chat_template_kwargs = None
        return self


def describe(reason: str, param: str | None = None, value: Any = NO_VALUE) -> str:
    """``param=value: reason``, ``param: reason``, ``value: reason`` or ``reason``."""
    shown = None if value is NO_VALUE else show(value)
    if param is None:
        return reason if shown is None else f"{shown}: {reason}"
    return f"{param}: {reason}" if shown is None else f"{param}={shown}: {reason}"


def show(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
