"""Agreement (extract, vote), and `batchgen moa` end to end in one process on tiny models."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from batchgen.cli import main
from batchgen.moa import make_extract, vote


@pytest.mark.parametrize("spec, text, want", [
    ("choice", "I think (B). Final answer: C", "C"),
    ("choice", "no letter here", None),
    ("boxed", r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}", "x^{2}"),
    ("number", "it costs 1,000.50 dollars, not 3", "3"),
    ("number", "total: 1,000.0", "1000"),
    ("json:answer", 'thinking {"x": 1} then {"answer": "Paris", "p": 0.9}', "Paris"),
    ("json:answer", '{"answer": [1, 2]}', "[1, 2]"),
    ("regex:ans=(\\w+)", "ans=foo ans=bar", "bar"),
    ("text", "  ", None),
])
def test_extract(spec: str, text: str, want: str | None) -> None:
    assert make_extract(spec)(text) == want


def test_extract_errors() -> None:
    with pytest.raises(ValueError, match="unknown"):
        make_extract("letters")
    with pytest.raises(ValueError, match="bad regular expression"):
        make_extract("regex:(")
    assert make_extract(str.upper)("a") == "A"


def test_vote() -> None:
    v = vote(["Paris", "paris.", " PARIS ", "Lyon"])
    assert (v.majority, v.count, v.confidence) == ("Paris", 3, 0.75)
    assert vote(["a", "b", "b", "a"]).majority == "a"  # ties: the earliest proposer's answer
    failed = vote([None, "x", None])
    assert failed.confidence == pytest.approx(1 / 3)  # a failed proposer counts against agreement
    assert vote([None, None]).majority is None and vote([None, None]).confidence == 0.0


def test_cli_moa_in_process(tmp_path: Path, checkpoint_factory) -> None:
    llama, qwen = checkpoint_factory("llama"), checkpoint_factory("qwen2")
    config = tmp_path / "moa.toml"
    config.write_text(f"""
aggregator = "q"
extract = "text"
skip_threshold = 0.6
chat = false
[proposers]
l1 = "{llama}"
l2 = "{llama}"
q = "{qwen}"
[sampling.default]
max_tokens = 3
temperature = 0.0
ignore_eos = true
[sampling.q]
max_tokens = 5
""")
    rows = tmp_path / "in.parquet"
    pd.DataFrame({"prompt": ["hello", "x = 1", "def"], "id": [7, 8, 9]}).to_parquet(rows)
    out_path = tmp_path / "out.parquet"
    assert main(["moa", "--config", str(config), "--input", str(rows), "--output", str(out_path)]) == 0
    out = pd.read_parquet(out_path)
    assert out["id"].tolist() == [7, 8, 9]
    assert (out["l1_text"] == out["l2_text"]).all()  # the same weights under two names agree
    assert (out["confidence"] >= 2 / 3 - 1e-9).all() and not out["aggregated"].any()
    assert (out["final_text"] == out["l1_text"]).all()
    assert main(["moa", "--config", str(config), "--input", str(rows), "--output", str(out_path)]) == 2  # exists
    bad = tmp_path / "bad.toml"
    bad.write_text('aggregator = "x"\nk_typo = 3\n[proposers]\na = "/nowhere"\n')
    assert main(["moa", "--config", str(bad), "--input", str(rows), "--output", str(tmp_path / "o.parquet")]) == 2
    json.dumps(out.to_dict("records"), default=str)
