"""Agreement (extract, vote), and `batchgen moa` end to end in one process on tiny models."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from batchgen.cli import main
from batchgen.moa import PlacementError, make_extract, vote


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


def test_cli_run_with_several_models(tmp_path: Path, checkpoint_factory) -> None:
    from batchgen import Engine, SamplingParams

    llama, qwen = checkpoint_factory("llama"), checkpoint_factory("qwen2")
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": m, "prompt": p, "max_tokens": 3, "temperature": 0, "ignore_eos": True}}
             for i, (m, p) in enumerate([("l", "hello"), ("q", "hello"), ("ghost", "x"), ("l", "def f")])]
    lines.append({"custom_id": "r9", "method": "POST", "url": "/v1/completions", "body": {"prompt": "no model"}})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    models = tmp_path / "models.toml"
    models.write_text(f'[models]\nl = "{llama}"\nq = "{qwen}"\n')
    out_path = tmp_path / "out.jsonl"
    # two of five rows fail on purpose: above the default error budget, so it is raised
    assert main(["run", "--models", str(models), "--input", str(src), "--output", str(out_path),
                 "--progress", "off", "--max-error-rate", "1"]) == 0
    records = {r["custom_id"]: r for r in map(json.loads, out_path.read_text().splitlines())}
    assert sorted(records) == ["r0", "r1", "r2", "r3", "r9"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for cid, model, path in (("r0", "l", llama), ("r1", "q", qwen), ("r3", "l", llama)):
        body = records[cid]["response"]["body"]
        prompt = next(x["body"]["prompt"] for x in lines if x["custom_id"] == cid)
        assert body["model"] == model
        assert body["choices"][0]["text"] == Engine(path).generate([prompt], params)[0].text
    for cid, value in (("r2", "'ghost'"), ("r9", None)):
        err = records[cid]["response"]["body"]["error"]
        assert records[cid]["response"]["status_code"] == 400 and err["code"] == "model_not_found"
        assert err["param"] == "body.model" and (value is None or value in err["message"])
    # --resume after the end: nothing runs again, nothing is duplicated
    assert main(["run", "--models", f"l={llama}", f"q={qwen}", "--input", str(src), "--output", str(out_path),
                 "--resume", "--progress", "off", "--max-error-rate", "1"]) == 0
    assert len(out_path.read_text().splitlines()) == 5
    assert main(["run", "--models", "l", "--input", str(src), "--output", str(tmp_path / "o2.jsonl")]) == 2


def test_simulated_expert_stage_uses_the_placement() -> None:
    from batchgen.moa.simulate import SimModel, simulate_expert_stage

    models = {"r": SimModel("qwen3-30b-a3b", "summarization", 5.0), "c": SimModel("qwen3-30b-a3b", "classification", 5.0),
              "s": SimModel("qwen3-30b-a3b", "classification", 5.0)}
    r = simulate_expert_stage(models, {"r": 120, "c": 20, "s": 20}, workers=3, sample_rows=32)
    ilp, rr = r["ilp"], r["round_robin"]
    assert len(ilp.placement.replicas["r"]) >= 2 and len(rr.placement.replicas["r"]) == 1
    assert ilp.makespan_s < rr.makespan_s
    assert set(ilp.worker_s) == {"gpu0", "gpu1", "gpu2"}
    none_routed = simulate_expert_stage(models, {"r": 40, "c": 0, "s": 0}, workers=2, sample_rows=16)["ilp"]
    assert set(none_routed.placement.replicas) == {"r"}  # a model no row is routed to is not placed
    with pytest.raises(PlacementError, match="missing \\['s'\\]"):
        simulate_expert_stage(models, {"r": 40, "c": 1}, workers=2)


def test_task_size_follows_the_group(checkpoint_factory) -> None:
    """About 8 tasks per (model, worker) group, never under 8 rows; rows_per_task fixes it."""
    from batchgen.moa.pool import ModelPool

    path = checkpoint_factory("llama")
    auto, fixed = ModelPool({"m": path}, placement="round_robin"), ModelPool({"m": path}, rows_per_task=4)
    assert [auto.task_size(n) for n in (1, 10, 64, 65, 1000)] == [8, 8, 8, 9, 125]
    assert fixed.task_size(1000) == 4
