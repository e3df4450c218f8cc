"""The shipped demo model: its data generator, its files, and its accuracy through batchgen's own
engine on freshly generated dates (a seed the training never used)."""
from __future__ import annotations

import datetime as dt
import json
import string
from pathlib import Path

import pytest

from batchgen import Engine, SamplingParams
from batchgen.demo import DEMO_INSTRUCTION, DEMO_PROMPT, demo_model_dir, variant_dirs
from batchgen.demo.accuracy import TRAINING_SEEDS, measure, parse_iso
from batchgen.demo.dates import FORMATS, WEEKDAYS, messy_date, messy_dates, two_digit_year
from batchgen.demo.table import make_rows, table_rows
from batchgen.tokenizer import Tokenizer

MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september",
          "october", "november", "december"]


def test_generator_covers_every_format_with_valid_dates_in_range() -> None:
    import random

    dates = messy_dates(3000, 99)
    assert {d.format for d in dates} == set(FORMATS)
    for d in dates:
        day = dt.date.fromisoformat(d.iso)
        assert 1950 <= day.year <= 2049
    assert messy_dates(50, 99) == dates[:50]  # seeded
    rng = random.Random(5)
    for _ in range(300):
        d = messy_date(rng, "with_weekday")
        day = dt.date.fromisoformat(d.iso)
        weekday = d.text.strip().split()[0].rstrip(",").lower()
        assert WEEKDAYS[day.weekday()].lower().startswith(weekday)  # the true weekday
    for _ in range(300):
        d = messy_date(rng, "us_slash")
        month, day_, year = d.text.strip().split("/")
        y = two_digit_year(int(year)) if len(year) == 2 else int(year)
        assert dt.date(y, int(month), int(day_)).isoformat() == d.iso
    texts = " ".join(d.text for d in dates)
    for needle in ("the ", "th of", "st,", ".", "\t", "  "):
        assert needle in texts
    assert any(d.text.strip().isdigit() and len(d.text.strip()) == 8 for d in dates)  # compact
    lowered = texts.lower()
    assert all(m in lowered and m[:3] in lowered for m in MONTHS)


def test_parse_iso() -> None:
    assert parse_iso(" 2021-03-07 ") == "2021-03-07"
    assert parse_iso("2021-02-30") is None and parse_iso("2021-3-7") is None and parse_iso("x2021-03-07") is None


def test_the_bundled_table_is_the_generated_one() -> None:
    rows = table_rows()
    assert rows == make_rows() and len(rows) == 300
    assert len({r["id"] for r in rows}) == 300


def test_checkpoint_files_and_prompt() -> None:
    path = demo_model_dir()
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in path.iterdir()) <= 10 * 2**20
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] > config["num_experts_per_tok"]
    fields = [f for _, f, _, _ in string.Formatter().parse(DEMO_PROMPT) if f is not None]
    assert fields == ["text"]


@pytest.mark.parametrize("name", ["demo", *sorted(variant_dirs())])
def test_chat_messages_give_the_tokens_of_demo_prompt(name: str) -> None:
    # chat prompts are encoded without special tokens (as transformers does): the template's
    # bos_token supplies the <s> a plain prompt gets, so both reach the model as it was trained
    path = demo_model_dir() if name == "demo" else variant_dirs()[name]
    tok = Tokenizer.from_dir(Path(path), [])
    text = " Sunday, March 7, 2021"
    messages = [{"role": "user", "content": DEMO_INSTRUCTION.format(text=text)}]
    chat = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    plain = tok.encode(DEMO_PROMPT.format(text=text))
    assert chat == plain and plain[0] == tok.bos_token_id
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert list(hf) == chat


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(demo_model_dir())


def test_exact_match_on_fresh_dates(engine: Engine) -> None:
    # 200 fresh dates: at the model's measured >=97% the count is below 186 with probability ~1e-4
    acc = measure(200, seed=12_345, engine=engine)
    assert acc.n == 200 and set(acc.by_format) == set(FORMATS)
    assert acc.exact >= 186, acc.describe() + f"; misses: {acc.misses[:10]}"
    assert acc.well_formed_rate >= 0.98


def test_measure_takes_sampling_params_and_refuses_training_seeds(engine: Engine) -> None:
    acc = measure(8, seed=3, engine=engine, sampling=SamplingParams(temperature=0.0, max_tokens=4))
    assert acc.n == 8 and acc.well_formed == 0  # 4 tokens cannot hold YYYY-MM-DD
    with pytest.raises(ValueError, match="training used"):
        measure(8, seed=TRAINING_SEEDS[0], engine=engine)
