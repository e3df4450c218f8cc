"""The bundled messy table `batchgen demo` cleans: customer sign-up dates as people type them.

`data/messy_dates.jsonl` holds {"id", "signup", "iso"} per row (JSON keeps stray whitespace and
tabs exactly); `write_table` regenerates it, deterministically, from batchgen.demo.dates with a
seed of its own, every format in turn.
"""
from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from .dates import FORMATS, messy_date

TABLE_SEED = 20_260_101
TABLE_ROWS = 300


def table_rows() -> list[dict[str, str | int]]:
    """The bundled rows: [{"id": 1, "signup": " Sunday, March 7, 2021", "iso": "2021-03-07"}, ...]."""
    text = (resources.files("batchgen.demo") / "data" / "messy_dates.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


def make_rows(n: int = TABLE_ROWS, seed: int = TABLE_SEED) -> list[dict[str, str | int]]:
    rng = random.Random(seed)
    names = list(FORMATS)
    rows = []
    for i in range(n):
        d = messy_date(rng, names[i % len(names)])
        rows.append({"id": i + 1, "signup": d.text, "iso": d.iso})
    rng.shuffle(rows)
    return rows


def write_table(path: Path | None = None) -> Path:
    path = path or Path(__file__).resolve().parent / "data" / "messy_dates.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_rows()), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(write_table())
