"""The columns `batchgen.generate` adds to a partition, with their final dtypes.

    generated_text, finish_reason, error, num_input_tokens, num_generated_tokens,
    num_cached_tokens, logprobs (only when a row may ask for them)

The names, the logprobs type and its cells are those of the Parquet file output (io/parquet.py,
io/logprobs.py), so a DataFrame job and a file job write the same columns. `output_prefix` renames them all; an input
column of the same name is refused before any work. See docs/guides/chat-dataframe.md.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pandas as pd

from ..io.logprobs import logprob_cell
from ..io.parquet import LOGPROBS_TYPE
from ..models.hub import model_dir
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer

BASE_COLUMNS = ("generated_text", "finish_reason", "error", "num_input_tokens", "num_generated_tokens",
                "num_cached_tokens")
LOGPROBS = "logprobs"
Decoder = Callable[[int], Tokenizer | None]  # row position -> the tokenizer of the model it ran on


@dataclass(frozen=True, slots=True)
class OutputColumns:
    prefix: str = ""
    logprobs: bool = False  # add the logprobs column

    @classmethod
    def make(cls, output_prefix: str, base: SamplingParams, per_row: Mapping[str, str]) -> OutputColumns:
        if not isinstance(output_prefix, str):
            raise TypeError(f"output_prefix must be a string, got {output_prefix!r}")
        return cls(output_prefix, base.logprobs is not None or "logprobs" in per_row)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.prefix + n for n in (*BASE_COLUMNS, *((LOGPROBS,) if self.logprobs else ())))

    def check_clash(self, columns: Sequence[Any]) -> None:
        """Refuse, before any work, an input column that an output column would overwrite."""
        clash = [c for c in self.names if c in set(columns)]
        if clash:
            raise ValueError(f"input column(s) {clash} would be overwritten by batchgen's output column(s) of "
                             f"the same name; rename them, or pass output_prefix= (e.g. output_prefix='out_') "
                             f"to name the output columns {self.prefix or 'out_'}generated_text, ...")

    def frame(self, pdf: pd.DataFrame, outputs: list[RequestOutput], decoder: Decoder,
              rename: tuple[str, str] | None = None) -> pd.DataFrame:
        """The input rows (same index, same order) plus the output columns. rename: the
        (engine's field name, the user's column name) that error messages start with."""
        errors = [None if o.error is None else f"row {idx}: {_renamed(o.error, rename)}"
                  for idx, o in zip(pdf.index, outputs)]
        values: dict[str, list[Any]] = {
            "generated_text": [o.text for o in outputs], "finish_reason": [o.finish_reason for o in outputs],
            "error": errors, "num_input_tokens": [o.num_prompt_tokens for o in outputs],
            "num_generated_tokens": [o.num_generated_tokens for o in outputs],
            "num_cached_tokens": [o.num_cached_tokens for o in outputs]}
        if self.logprobs:
            values[LOGPROBS] = [logprob_cell(o, decoder(i)) for i, o in enumerate(outputs)]
        return self._assign(pdf, values)

    def placeholder(self, pdf: pd.DataFrame) -> pd.DataFrame:
        """The schema answer for a meta call or an empty partition: no model is touched."""
        n = len(pdf)
        values: dict[str, list[Any]] = {"generated_text": [""] * n, "finish_reason": ["length"] * n,
                                        "error": [None] * n, **{c: [0] * n for c in BASE_COLUMNS[3:]}}
        if self.logprobs:
            values[LOGPROBS] = [None] * n
        return self._assign(pdf, values)

    def _assign(self, pdf: pd.DataFrame, values: dict[str, list[Any]]) -> pd.DataFrame:
        text = pd.Series(["x"]).dtype  # pandas' own string dtype: `str` in pandas 3, object before
        dtypes = {"generated_text": text, "finish_reason": text, "error": text, LOGPROBS: pd.ArrowDtype(LOGPROBS_TYPE),
                  **{c: "int64" for c in BASE_COLUMNS[3:]}}
        return pdf.assign(**{self.prefix + name: pd.Series(v, index=pdf.index, dtype=dtypes[name])
                             for name, v in values.items()})


@lru_cache(maxsize=16)
def tokenizer_for(model: str) -> Tokenizer | None:
    """The tokenizer of an engine's model, read once per process (logprob tokens as text)."""
    return Tokenizer.from_dir(model_dir(model, weights=False), [])


def _renamed(message: str, rename: tuple[str, str] | None) -> str:
    if rename is not None and message.startswith(rename[0]) and rename[0] != rename[1]:
        return rename[1] + message[len(rename[0]):]
    return message
