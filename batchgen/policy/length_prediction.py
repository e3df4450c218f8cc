"""Output lengths predicted online from the rows that finished: per group, and given a row's age.

Pure (no clock, randomness or I/O): the engine's scheduler feeds it each row that finishes and
asks it for a waiting row's expected length (length-aware admission, runtime/length_order.py);
the simulator drives the same object. Design and figures: docs/benchmarks/sim.md (length-aware).

- A row's *key* is the group its caller names (a template, a source column value) or, without
  one, its prompt length's power-of-two bucket. Each key keeps the mean output length of its
  finished rows (an exponentially weighted mean over about `window` rows, so statistics that
  drift are followed); a prediction is that mean capped by the row's max_tokens.
- Predictions are *used* only while they have earned it: at least `min_finished` rows finished,
  and over the last `window` / 4 finishes (shorter than the means' window, so a flip shows
  before the means have followed it) the keys' predictions (made before each row's own length
  was added) erred less, in |log| ratio, than the pooled mean of all rows by at least `margin`.
  Otherwise `predict` returns None and the caller keeps arrival order: today's decisions. Rows
  all of one length (every row stops at max_tokens) leave both errors at 0: nothing to act on.
"""
from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    min_finished: int = 64  # finished rows before any prediction is used
    min_group: int = 8  # finished rows of a key before its own mean is used (else the pooled mean)
    window: int = 256  # rows the means average over (the recent error: a quarter of it)
    margin: float = 0.1  # keys must beat the pooled mean's recent error by this share

    def __post_init__(self) -> None:
        if self.min_finished < 1 or self.min_group < 1 or self.window < 1:
            raise ValueError(f"min_finished, min_group and window must be >= 1, got {self}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"PredictorConfig.margin must be in [0, 1), got {self.margin!r}")


def length_key(group: Hashable | None, prompt_len: int) -> Hashable:
    """The key a row's statistics are kept under: its group, else its prompt-length bucket."""
    return group if group is not None else ("prompt", max(0, int(prompt_len)).bit_length())


@dataclass(slots=True)
class _Mean:
    count: int = 0
    mean: float = 0.0

    def add(self, x: float, window: int) -> None:
        self.count += 1
        self.mean += (x - self.mean) / min(self.count, window)


def _log_error(predicted: float, actual: int) -> float:
    return abs(math.log((predicted + 1.0) / (actual + 1.0)))


@dataclass(slots=True)
class LengthPredictor:
    config: PredictorConfig = field(default_factory=PredictorConfig)
    finished: int = 0
    version: int = 0  # bumped by every observation: callers cache decisions until it moves
    pooled: _Mean = field(default_factory=_Mean)
    keys: dict[Hashable, _Mean] = field(default_factory=dict)
    key_error: float = 0.0  # recent mean |log| error of the keys' predictions
    pooled_error: float = 0.0  # the same for the pooled mean

    def observe(self, key: Hashable, length: int) -> None:
        """A row of `key` finished after generating `length` tokens."""
        c = self.config
        if self.pooled.count:  # prequential: score the predictions made before this row counted
            n = min(self.finished + 1, max(1, c.window // 4))
            own = self._mean(key)
            self.key_error += (_log_error(own, length) - self.key_error) / n
            self.pooled_error += (_log_error(self.pooled.mean, length) - self.pooled_error) / n
        self.keys.setdefault(key, _Mean()).add(length, c.window)
        self.pooled.add(length, c.window)
        self.finished += 1
        self.version += 1

    def _mean(self, key: Hashable) -> float:
        stat = self.keys.get(key)
        return stat.mean if stat is not None and stat.count >= self.config.min_group else self.pooled.mean

    @property
    def confident(self) -> bool:
        """Are the keys' predictions worth acting on (see the module docstring)?"""
        c = self.config
        return (self.finished >= c.min_finished and self.pooled_error > 0.0
                and self.key_error <= (1.0 - c.margin) * self.pooled_error)

    def predict(self, key: Hashable, max_tokens: int) -> float | None:
        """Expected output tokens of a waiting row of `key`; None: no usable prediction."""
        if not self.confident:
            return None
        return min(self._mean(key), float(max_tokens))
