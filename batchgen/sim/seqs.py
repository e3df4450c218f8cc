"""Simulated rows as the runtime's own `Sequence` objects: token lists are `range`s (the policy
reads only their lengths), and the row's true output length rides in its params."""
from __future__ import annotations

from ..runtime.sequence import Sequence


class SimRequest:
    """A simulated row's `params`. The policy reads max_tokens (its upper bound, as in the
    runtime); output_len is when the row really stops (EOS), known only to the simulator.
    A plain class with slots: a million are made per run, each in a third of a frozen
    dataclass's time (no object.__setattr__ per field), read as fast."""

    __slots__ = ("max_tokens", "output_len", "stop_at", "group")

    def __init__(self, max_tokens: int, output_len: int, stop_at: int, group: int | None = None) -> None:
        self.max_tokens, self.output_len = max_tokens, output_len
        self.stop_at = stop_at  # min(max_tokens, output_len): a field, read once per row per slice
        self.group = group  # the row's source/template, as a real row's column names it

    def __repr__(self) -> str:
        return f"SimRequest(max_tokens={self.max_tokens}, output_len={self.output_len})"


_NO_OUTPUT = range(0)  # shared: a row's output_ids is replaced, never changed in place


def make_sequence(row: int, prompt_len: int, max_tokens: int, output_len: int, group: int | None = None) -> Sequence:
    """A row's Sequence, made a million times a run: positional fields and no helper calls
    (SeqId(row) is row at run time) take half the time of the keyword form."""
    stop_at = max_tokens if max_tokens < output_len else output_len
    return Sequence(row, row, range(prompt_len), SimRequest(max_tokens, output_len, stop_at, group),  # type: ignore[arg-type]
                    0, _NO_OUTPUT)  # type: ignore[arg-type]


def row_group(seq: Sequence) -> int | None:
    """A simulated row's group, for length-aware admission (Scheduler's group_of)."""
    return seq.params.group

