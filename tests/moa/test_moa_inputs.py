"""Bad inputs to MoA, `batchgen moa`, `batchgen run --models` and model_column: a clear error,
before any work for the job's own settings, for that row alone for a row's."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from batchgen.cli import main
from batchgen.errors import BatchgenError, ModelLoadError

PARAMS = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose tokenizer has no chat template."""
    import tiny_models

    path = tiny_models.build_checkpoint("llama", tmp_path_factory.mktemp("plain"), seed=3)
    tiny_models.build_tokenizer(path, chat_template=False)
    return path


@pytest.fixture(scope="module")
def dirs(checkpoint_factory, plain: Path) -> dict[str, Path]:
    return {"l": checkpoint_factory("llama"), "q": checkpoint_factory("qwen2"), "p": plain}


def make(dirs: dict[str, Path], **kw):
    from batchgen.moa import MoA

    args = {"proposers": {"l": dirs["l"], "q": dirs["q"]}, "aggregator": "l", "default_sampling": PARAMS,
            "chat": False, **kw}
    return MoA(**args)


@pytest.mark.parametrize("kw, match", [
    ({"k": 1.5}, "k must be an integer"),
    ({"layers": 0}, "layers must be an integer"),
    ({"skip_threshold": "0.5"}, "skip_threshold must be a number"),
    ({"skip_threshold": 1.5}, "skip_threshold must be a number"),
    ({"route": 5}, "route must be a column name"),
    ({"placement": "fastest"}, "placement 'fastest' unknown"),
    ({"extract": "letters"}, "extract='letters' unknown"),
    ({"extract": "regex:("}, "bad regular expression"),
    ({"sampling": {"q": {"max_tokenz": 3}}}, r"sampling\['q'\]: unknown sampling parameter 'max_tokenz'"),
    ({"aggregator": "zz"}, "aggregator 'zz' is neither"),
    ({"template": "{answers}: {prompt}"}, "template: KeyError\\('answers'\\); it may name only"),
    ({"engine_options": {"max_num_seqs": -3}}, "engine_options: EngineConfig.max_num_seqs must be a positive"),
])
def test_bad_settings_fail_at_construction(dirs: dict[str, Path], kw: dict, match: str) -> None:
    with pytest.raises(BatchgenError, match=match):
        make(dirs, **kw)


def test_bad_models_fail_fast_naming_the_model(dirs: dict[str, Path], tmp_path: Path) -> None:
    bogus, weightless = tmp_path / "bogus", tmp_path / "weightless"
    bogus.mkdir()
    (bogus / "config.json").write_text('{"model_type": "gpt-bogus"}')
    weightless.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (weightless / name).write_bytes((dirs["l"] / name).read_bytes())
    for path, match in ((bogus, "not supported"), (weightless, "no \\*.safetensors"), (tmp_path / "nowhere", "no config")):
        with pytest.raises(BatchgenError, match=f"model 'x'.*{match}"):
            make(dirs, proposers={"l": dirs["l"], "x": path})
    with pytest.raises(BatchgenError, match="may not be named 'final'"):  # its columns would be the job's own
        make(dirs, proposers={"l": dirs["l"], "final": dirs["q"]})
    with pytest.raises(BatchgenError, match="both proposers and models"):
        make(dirs, models={"q": dirs["l"]})
    with pytest.raises(BatchgenError, match=r"chat=True, but models \['p'\] have no chat template"):
        make(dirs, proposers={"l": dirs["l"], "p": dirs["p"]}, chat=True)
    numbered = make(dirs, proposers={1: dirs["l"], 2: dirs["q"]}, aggregator=1)  # names are matched as text
    assert numbered.proposers == ["1", "2"] and numbered._experts({}) == ["1", "2"]
    # a dict over the job-wide default: only the keys it sets, aliases as in a request body
    job = make(dirs, sampling={"q": {"max_completion_tokens": 5}})
    assert job.sampling["q"].max_tokens == 5 and job.sampling["q"].ignore_eos and job.sampling["l"].max_tokens == 2


def test_row_problems_fail_their_rows_alone(dirs: dict[str, Path]) -> None:
    def extract(text: str) -> str:
        raise ZeroDivisionError("no answer here")

    frame = pd.DataFrame({"prompt": ["hello", "x", "y", "z", ""],
                          "experts": [["l", "q"], None, 5, ["q", "ghost"], ["l"]]})
    out = make(dirs, route="experts", extract=extract, skip_threshold=float("inf")).generate(frame)
    assert out["error"][1] == "row 1: route: route gave no experts (None/NA)"
    assert "route must give a proposer name or a list of them, got 5" in out["error"][2]
    assert "['ghost']" in out["error"][3] and "must be a non-empty string" in out["error"][4]
    # a raising extract function: the row still runs to the end, its answers missing, the error says why
    first = out.iloc[0]
    assert isinstance(first["l_text"], str) and isinstance(first["q_text"], str) and pd.isna(first["l_answer"])
    assert first["aggregated"] and isinstance(first["final_text"], str)
    assert "l: extract: ZeroDivisionError: no answer here" in first["error"] and "aggregator: extract" in first["error"]
    job = make(dirs)
    job.generate(frame.iloc[:1])
    stats = dict(job.stats)  # a mapping as well as attributes
    assert {"expert_stage_s", "aggregator_stage_s", "total_s", "rows_skipped", "rows_aggregated", "placement"} <= set(stats)
    assert job.stats["rows_skipped"] + job.stats["rows_aggregated"] == 1 and "ilp" in job.stats["placement"]
    with pytest.raises(KeyError, match="route 'nope' is not a column"):
        make(dirs, route="nope").generate(frame)


def test_chat_template_is_per_model(dirs: dict[str, Path]) -> None:
    """A chat aggregator beside a proposer without a chat template: each model gets its own
    form (it once sent every model chat messages, and the plain one failed the job)."""
    from batchgen import Engine, SamplingParams
    from batchgen.models.info import ModelInfo

    job = make(dirs, proposers={"l": dirs["l"], "p": dirs["p"]}, chat=None, skip_threshold=float("inf"))
    out = job.generate(pd.DataFrame({"prompt": ["hello"]}))
    assert out["error"].isna().all() and out["aggregated"].all()
    params = SamplingParams(**PARAMS)
    tok = ModelInfo.load(dirs["l"]).tokenizer
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello"}]), add_special_tokens=False)
    assert out["l_text"][0] == Engine(dirs["l"]).generate([chat_ids], params)[0].text
    assert out["p_text"][0] == Engine(dirs["p"]).generate(["hello"], params)[0].text


def test_model_column_checks_every_model_and_matches_non_string_names(dirs: dict[str, Path]) -> None:
    import batchgen

    frame = pd.DataFrame({"prompt": ["hello", "x"], "m": [1, 2]})
    with pytest.raises(ModelLoadError, match="model 'ghost'"):  # even if no row names it
        batchgen.generate(frame, model={1: dirs["l"], "ghost": "/nowhere"}, model_column="m", **PARAMS)
    out = batchgen.generate(frame, model={1: dirs["l"]}, model_column="m", **PARAMS)
    assert pd.isna(out["error"][0]) and out["num_generated_tokens"][0] == 2
    assert "m=2: unknown model" in out["error"][1]


def test_cli_yaml_maps_and_bad_configs(dirs: dict[str, Path], tmp_path: Path) -> None:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": m, "prompt": "hello", **PARAMS}} for i, m in enumerate(["l", "ghost"])]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  l: {dirs['l']}\n")
    out_path = tmp_path / "out.jsonl"
    assert main(["run", "--models", str(models), "--input", str(src), "--output", str(out_path),
                 "--progress", "off", "--max-error-rate", "1"]) == 0  # one of two rows fails on purpose
    records = {r["custom_id"]: r["response"] for r in map(json.loads, out_path.read_text().splitlines())}
    assert records["r0"]["status_code"] == 200 and records["r1"]["body"]["error"]["code"] == "model_not_found"

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hello"}\n')
    config = tmp_path / "moa.yaml"
    base = f"aggregator: l\nproposers: {{l: {dirs['l']}, q: {dirs['q']}}}\nsampling: {{default: {{max_tokens: 2}}}}\n"
    for extra in ("k: three\n", "extract: letters\n", "route: experts\n", "workers: two\n"):
        config.write_text(base + extra)
        assert main(["moa", "--config", str(config), "--input", str(rows), "--output", str(tmp_path / "o.jsonl")]) == 2
    config.write_text(base.replace("q: ", "l: "))  # a proposer named twice (PyYAML alone keeps the last)
    assert main(["moa", "--config", str(config), "--input", str(rows), "--output", str(tmp_path / "o.jsonl")]) == 2
    config.write_text(base)
    empty, result = tmp_path / "empty.jsonl", tmp_path / "empty_out.jsonl"
    empty.write_text("")
    assert main(["moa", "--config", str(config), "--input", str(empty), "--output", str(result)]) == 0
    assert result.read_text() == ""
