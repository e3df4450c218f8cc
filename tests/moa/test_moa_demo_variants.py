"""MoA with real trained proposers (the shipped demo variants, which disagree on some dates): the
rows at or above skip_threshold, and only those, skip the aggregator and take the majority answer
(the text of the first proposer that gave it); the others get the aggregator's answer to the
template. In one process, so it stays fast."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from batchgen import Engine, SamplingParams
from batchgen.demo import DEMO_PROMPT, demo_model_dir, variant_dirs
from batchgen.demo.accuracy import parse_iso
from batchgen.demo.dates import messy_dates
from batchgen.moa import MoA, vote

PARAMS = {"temperature": 0.0, "max_tokens": 16}
TEMPLATE = "{prompt}"  # the aggregator's own training prompt (it was never trained to read proposals)


# about 62%, 89% and 90% alone on fresh dates: they disagree on enough rows
NAMES = ("h64-l2-seed17", "h48-l2-seed12", "h64-l3-seed14")


@pytest.fixture(scope="module")
def proposers() -> dict[str, Path]:
    dirs = variant_dirs()
    missing = [n for n in NAMES if n not in dirs]
    assert not missing, f"demo variants {missing} are not in the package (it has {sorted(dirs)})"
    return {n: dirs[n] for n in NAMES}


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    dates = messy_dates(48, 4_242)
    return pd.DataFrame({"prompt": [DEMO_PROMPT.format(text=d.text) for d in dates], "gold": [d.iso for d in dates]})


def test_bypass_takes_the_majority_at_or_above_the_threshold(proposers: dict[str, Path], frame: pd.DataFrame) -> None:
    threshold = 2 / 3
    job = MoA(proposers, aggregator="demo", models={"demo": demo_model_dir()}, k=3, skip_threshold=threshold,
              extract=parse_iso, default_sampling=PARAMS, chat=False, template=TEMPLATE, rows_per_task=16)
    out = job.generate(frame)
    names = list(proposers)
    params = SamplingParams(**PARAMS)
    alone = {n: [o.text for o in Engine(d).generate(frame["prompt"].tolist(), params)] for n, d in proposers.items()}
    confidence = out["confidence"].astype(float)
    levels = set(confidence.round(6))
    # the variants disagree somewhere: every level of agreement is present, the boundary included
    assert {1.0, round(2 / 3, 6)} <= levels and min(levels) < threshold, levels
    assert (out["aggregated"] == (confidence < threshold)).all()  # exactly the rows below it are aggregated
    assert job.stats.rows_skipped == int((confidence >= threshold).sum()) > 0
    assert job.stats.rows_aggregated == int((confidence < threshold).sum()) > 0
    agg_prompts, outvoted = [], 0
    for i, (_idx, row) in enumerate(out.iterrows()):
        answers = [parse_iso(alone[n][i]) for n in names]
        assert [row[f"{n}_text"] for n in names] == [alone[n][i] for n in names]
        v = vote(answers, 3)
        assert row["confidence"] == pytest.approx(v.confidence)
        if not row["aggregated"]:
            assert row["final_answer"] == v.majority
            first = next(n for n, a in zip(names, answers) if a == v.majority)
            assert row["final_text"] == alone[first][i]
            outvoted += answers[0] != v.majority
        else:
            agg_prompts.append(row["prompt"])
    assert outvoted > 0  # some skipped row's first proposer was outvoted: the majority, not the first, is taken
    # aggregated rows: the aggregator alone on the template (here: the row's own prompt)
    want = [o.text for o in Engine(demo_model_dir()).generate(agg_prompts, params)]
    assert out.loc[out["aggregated"], "final_text"].tolist() == want
