"""Messy dates and their ISO 8601 answers: the demo model's task, its training data and its test.

Pure Python (no torch): the training script, the accuracy check, the bundled table and the tests
draw from the same generator, so "fresh dates" means a seed the training never used.
Every format below is one function `(date, rng) -> str`; `FORMATS` names them.
"""
from __future__ import annotations

import calendar
import datetime as dt
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

MONTHS = tuple(calendar.month_name[m] for m in range(1, 13))  # locale-free: "January" ...
MONTH_ABBR = tuple(name[:3] for name in MONTHS)
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
FIRST, LAST = dt.date(1950, 1, 1), dt.date(2049, 12, 31)
ISO_RE = re.compile(r"\d{4}-\d{2}-\d{2}")

Rng = random.Random


def ordinal(day: int) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def _case(word: str, rng: Rng) -> str:
    """Any case: mostly as written, lower or upper, sometimes mixed letter by letter."""
    r = rng.random()
    if r < 0.45:
        return word
    if r < 0.7:
        return word.lower()
    if r < 0.9:
        return word.upper()
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in word)


def _month(d: dt.date, rng: Rng) -> str:
    name = MONTHS[d.month - 1] if rng.random() < 0.5 else MONTH_ABBR[d.month - 1]
    if len(name) == 3 and rng.random() < 0.2:
        name += "."
    return _case(name, rng)


def _num(n: int, rng: Rng, pad: bool | None = None) -> str:
    pad = rng.random() < 0.5 if pad is None else pad
    return f"{n:02d}" if pad else str(n)


def _year(d: dt.date, rng: Rng, two_digit: float = 0.0) -> str:
    return f"{d.year % 100:02d}" if rng.random() < two_digit else str(d.year)


def _day(d: dt.date, rng: Rng) -> str:
    return ordinal(d.day) if rng.random() < 0.3 else str(d.day)


def iso(d: dt.date, rng: Rng) -> str:
    return d.isoformat()


def us_slash(d: dt.date, rng: Rng) -> str:  # 03/07/2021, 3/7/2021, 3/7/21
    return f"{_num(d.month, rng)}/{_num(d.day, rng)}/{_year(d, rng, 0.35)}"


def us_dash(d: dt.date, rng: Rng) -> str:  # 03-07-2021, 3-7-21
    return f"{_num(d.month, rng)}-{_num(d.day, rng)}-{_year(d, rng, 0.3)}"


def month_day_year(d: dt.date, rng: Rng) -> str:  # March 7, 2021 / Mar 7 2021 / March 7th, 2021
    comma = "," if rng.random() < 0.6 else ""
    return f"{_month(d, rng)} {_day(d, rng)}{comma} {d.year}"


def day_month_year(d: dt.date, rng: Rng) -> str:  # 7 March 2021 / 7 mar 2021 / 7th March 2021
    return f"{_day(d, rng)} {_month(d, rng)} {d.year}"


def the_day_of_month(d: dt.date, rng: Rng) -> str:  # the 7th of March, 2021
    the = _case("the", rng) + " " if rng.random() < 0.8 else ""
    comma = "," if rng.random() < 0.7 else ""
    return f"{the}{ordinal(d.day)} of {_month(d, rng)}{comma} {d.year}"


def with_weekday(d: dt.date, rng: Rng) -> str:  # Sunday, March 7, 2021 (the true weekday)
    day = WEEKDAYS[d.weekday()]
    day = day[:3] if rng.random() < 0.3 else day
    rest = month_day_year(d, rng) if rng.random() < 0.7 else day_month_year(d, rng)
    sep = ", " if rng.random() < 0.7 else " "
    return f"{_case(day, rng)}{sep}{rest}"


def european_dotted(d: dt.date, rng: Rng) -> str:  # 07.03.2021 (day first)
    return f"{_num(d.day, rng)}.{_num(d.month, rng)}.{d.year}"


def year_dotted(d: dt.date, rng: Rng) -> str:  # 2021.03.07
    return f"{d.year}.{d.month:02d}.{d.day:02d}"


def compact(d: dt.date, rng: Rng) -> str:  # 20210307
    return d.strftime("%Y%m%d")


FORMATS: dict[str, Callable[[dt.date, Rng], str]] = {
    f.__name__: f for f in (iso, us_slash, us_dash, month_day_year, day_month_year, the_day_of_month,
                            with_weekday, european_dotted, year_dotted, compact)
}


def random_date(rng: Rng) -> dt.date:
    return FIRST + dt.timedelta(days=rng.randrange((LAST - FIRST).days + 1))


def _stray_whitespace(text: str, rng: Rng) -> str:
    """Spaces (sometimes a tab) before, after, or doubled inside: what copy-paste leaves."""
    if rng.random() < 0.25:
        text = " " * rng.randint(1, 3) + text
    if rng.random() < 0.25:
        text += rng.choice((" ", "  ", "\t"))
    if " " in text and rng.random() < 0.15:
        i = rng.choice([i for i, c in enumerate(text) if c == " "])
        text = text[:i] + " " + text[i:]
    return text


@dataclass(frozen=True, slots=True)
class MessyDate:
    text: str  # what a user typed
    iso: str  # YYYY-MM-DD
    format: str  # a FORMATS key


def messy_date(rng: Rng, fmt: str | None = None) -> MessyDate:
    """One valid calendar date in 1950-2049, written in `fmt` (default: any of FORMATS)."""
    fmt = fmt or rng.choice(list(FORMATS))
    d = random_date(rng)
    return MessyDate(_stray_whitespace(FORMATS[fmt](d, rng), rng), d.isoformat(), fmt)


def messy_dates(n: int, seed: int) -> list[MessyDate]:
    rng = random.Random(seed)
    return [messy_date(rng) for _ in range(n)]


def stream(seed: int) -> Iterator[MessyDate]:
    rng = random.Random(seed)
    while True:
        yield messy_date(rng)


def two_digit_year(yy: int) -> int:
    """The rule the model learned: 00-49 -> 20xx, 50-99 -> 19xx."""
    return 2000 + yy if yy < 50 else 1900 + yy
