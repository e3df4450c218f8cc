"""An engine's measured speed, from (time, tokens generated, rows waiting) samples. No clock.

The caller passes the time: the runner its monotonic clock, the simulator its simulated one, so
both report the `speed` that balance.py weighs work by in the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

SPEED_WINDOW_S = 1.0
SPEED_DECAY = 0.99  # per one-second rate sample


@dataclass(slots=True)
class SpeedMeter:
    """`tokens_per_s`: smoothed rate of the last windows. `speed`: the peak rate of windows in
    which rows queued at every sample (the batch was as big as the engine allows: a rate then is
    capacity, not load), slowly forgotten while saturated (half-life ~70 saturated seconds) so a
    device that got slower (shared) is followed; unsaturated windows leave it as it is."""

    last_t: float
    last_tokens: int = 0
    tokens_per_s: float = 0.0
    speed: float = 0.0
    saturated: bool = False  # rows waited at every sample of the current window

    def observe(self, now: float, generated: int, waiting: int) -> None:
        self.saturated = self.saturated and waiting > 0
        if now - self.last_t < SPEED_WINDOW_S:
            return
        rate = (generated - self.last_tokens) / (now - self.last_t)
        self.tokens_per_s = rate if self.tokens_per_s == 0 else 0.5 * self.tokens_per_s + 0.5 * rate
        if self.saturated:
            self.speed = max(rate, SPEED_DECAY * self.speed)
        self.last_t, self.last_tokens, self.saturated = now, generated, waiting > 0


def at_capacity(waiting: int, running: int, max_num_seqs: int, kv_used: float, kv_full: float = 0.8) -> bool:
    """Rows wait because the engine holds no more (its batch is at max_num_seqs, or its KV pool
    is nearly full), not merely for their prefill's turn under the per-step token budget: at the
    start of a job every row waits a step or two while the batch is far from full, and a rate
    taken then measures prefill, not the engine's capacity (two equal engines came out 2x apart
    that way and the balancer moved work on it). The runner passes `waiting` to `observe` only
    when this holds."""
    return waiting > 0 and (running >= max_num_seqs or kv_used >= kv_full)

