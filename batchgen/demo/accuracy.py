"""How well the demo model cleans dates: exact match and well-formed share, per format.

    python -m batchgen.demo.accuracy [--n 1000] [--seed 7] [--model DIR]
    measure(n=1000, seed=7, sampling=SamplingParams(temperature=0.0, max_tokens=16))

Fresh dates come from batchgen.demo.dates with a seed the training never used (TRAINING_SEEDS). `sampling` is any SamplingParams (structured output included),
so the same measurement reruns with a constraint on the answer.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .dates import ISO_RE, MessyDate, messy_dates
from .prompt import DEMO_MAX_TOKENS, DEMO_PROMPT

if TYPE_CHECKING:
    from ..engine import Engine
    from ..sampling_params import SamplingParams

TRAINING_SEEDS = (0, 1, 2, 1_000_003)  # stage 1 data, tokenizer, stage 2 data, dev


def parse_iso(text: str) -> str | None:
    """The answer if it is exactly one valid YYYY-MM-DD date (surrounding whitespace allowed)."""
    text = text.strip()
    if not ISO_RE.fullmatch(text):
        return None
    try:
        return dt.date.fromisoformat(text).isoformat()
    except ValueError:
        return None


@dataclass
class Accuracy:
    n: int = 0
    exact: int = 0
    well_formed: int = 0
    by_format: dict[str, list[int]] = field(default_factory=dict)  # format -> [right, n]
    misses: list[tuple[str, str, str]] = field(default_factory=list)  # (input, expected, got)

    def add(self, date: MessyDate, output: str) -> bool:
        got = parse_iso(output)
        right = got == date.iso
        self.n += 1
        self.exact += right
        self.well_formed += got is not None
        counts = self.by_format.setdefault(date.format, [0, 0])
        counts[0] += right
        counts[1] += 1
        if not right:
            self.misses.append((date.text, date.iso, output))
        return right

    @property
    def exact_match(self) -> float:
        return self.exact / self.n if self.n else 0.0

    @property
    def well_formed_rate(self) -> float:
        return self.well_formed / self.n if self.n else 0.0

    def describe(self) -> str:
        per = ", ".join(f"{k} {r}/{n}" for k, (r, n) in sorted(self.by_format.items()))
        return (f"exact match {self.exact}/{self.n} ({100 * self.exact_match:.1f}%), well-formed "
                f"{100 * self.well_formed_rate:.1f}%; by format: {per}")

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "exact_match": self.exact_match, "well_formed": self.well_formed_rate,
                "by_format": {k: v[0] / v[1] for k, v in sorted(self.by_format.items())}}


def default_sampling() -> SamplingParams:
    from ..sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=DEMO_MAX_TOKENS)


def score(engine: Engine, dates: list[MessyDate], sampling: SamplingParams | None = None) -> Accuracy:
    """Run `dates` through `engine` (greedy unless `sampling` says otherwise) and score them."""
    outputs = engine.generate([DEMO_PROMPT.format(text=d.text) for d in dates], sampling or default_sampling())
    acc = Accuracy()
    for d, out in zip(dates, outputs):
        acc.add(d, out.text if out.error is None else "")
    return acc


def measure(n: int = 1000, seed: int = 7, sampling: SamplingParams | None = None,
            model: str | Path | None = None, engine: Engine | None = None, **engine_options: Any) -> Accuracy:
    """Exact match of the demo model (or `model`, or `engine`) on `n` fresh dates from `seed`."""
    if seed in TRAINING_SEEDS:
        raise ValueError(f"seed {seed} is one the training used; pick another")
    if engine is None:
        from ..engine import Engine
        from . import demo_model_dir

        engine = Engine(model or demo_model_dir(), **engine_options)
    return score(engine, messy_dates(n, seed), sampling)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="exact match of the demo model on fresh messy dates")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", help="model directory (default: the shipped demo model)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    acc = measure(args.n, args.seed, model=args.model)
    print(json.dumps(acc.as_dict(), indent=2) if args.json else acc.describe())
    for text, want, got in acc.misses[:10]:
        print(f"  miss: {text!r} -> {got!r} (expected {want})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
