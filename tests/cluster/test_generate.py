"""batchgen.cluster.generate without a cluster: plain pandas, dask's local schedulers, meta calls."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from batchgen import Engine, SamplingParams
from batchgen.cluster import generate
from batchgen.cluster.frame import OUTPUT_COLUMNS, read_requests
from batchgen.cluster.spec import EngineSpec
from batchgen.cluster.worker import local_host

OPTIONS = {"kv_cache_bytes": 16 << 20}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("mixtral")


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> Callable[[list[Any], list[int]], list[str]]:
    engine = Engine(ckpt, **OPTIONS)

    def run(prompts: list[Any], max_tokens: list[int]) -> list[str]:
        outs = engine.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens])
        return [o.text for o in outs]
    return run


def frame(prompt_ids: list[list[int]]) -> pd.DataFrame:
    texts = ["The quick brown fox", "def f(x):", "a", "Hello, world! " * 3, "x = 1\ny = 2"]
    prompts: list[Any] = texts + [prompt_ids[i] for i in (2, 4, 5)]
    index = [17, 3, 11, 5, 42, 8, 0, 99]  # not sorted, not a range: order and index must survive
    return pd.DataFrame({"prompt": pd.Series(prompts, index=index, dtype=object),
                         "max_tokens": [3, 9, 1, 6, 4, 7, 2, 5]}, index=index)


def test_plain_pandas_matches_the_engine(ckpt: Path, prompt_ids: list[list[int]], reference: Any) -> None:
    pdf = frame(prompt_ids)
    out = generate(pdf, model=ckpt, per_row={"max_tokens": "max_tokens"}, engine_options=OPTIONS, **GREEDY)
    assert list(out.index) == list(pdf.index)
    assert list(out.columns) == [*pdf.columns, *OUTPUT_COLUMNS]
    pd.testing.assert_frame_equal(out[list(pdf.columns)], pdf)
    assert out["generated_text"].tolist() == reference(pdf["prompt"].tolist(), pdf["max_tokens"].tolist())
    assert out["num_generated_tokens"].tolist() == pdf["max_tokens"].tolist()
    assert set(out["finish_reason"]) == {"length"}
    assert out["error"].isna().all()
    assert out["num_generated_tokens"].dtype == np.int64


def test_bad_rows_get_error_rows_and_the_others_go_on(ckpt: Path, prompt_ids: list[list[int]],
                                                      reference: Any) -> None:
    good = ["The quick brown fox", prompt_ids[3]]
    pdf = pd.DataFrame({
        "prompt": pd.Series([good[0], None, "", [1, 2, 100_000], "ok", "fine", good[1]], dtype=object),
        "max_tokens": [4, 4, 4, 4, -3, None, 5],
        "temperature": [0.0, 0.0, 0.0, 0.0, 0.0, "hot", 0.0],
    })
    out = generate(pdf, model=ckpt, per_row={"max_tokens": "max_tokens", "temperature": "temperature"},
                   engine_options=OPTIONS, ignore_eos=True)
    assert out["finish_reason"].tolist() == ["length", "error", "error", "error", "error", "error", "length"]
    errors = out["error"].tolist()
    assert pd.isna(errors[0]) and pd.isna(errors[6])
    assert errors[1].startswith("row 1: prompt") and "NoneType" in errors[1]
    assert "row 2: prompt must not be empty" in errors[2]
    assert "100000" in errors[3] and "position 2" in errors[3]
    assert "max_tokens" in errors[4] and "-3" in errors[4]
    assert "temperature" in errors[5] and "'hot'" in errors[5]
    assert out["generated_text"].tolist()[1:6] == [""] * 5
    assert [out["generated_text"][0], out["generated_text"][6]] == reference(good, [4, 5])


def test_per_row_values_are_made_plain() -> None:
    pdf = pd.DataFrame({"prompt": pd.Series([np.array([1, 2, 3]), "hi", [4, 5]], dtype=object),
                        "mt": [2.0, np.nan, 7.0], "seed": pd.array([1, None, 3], dtype="Int64")})
    requests = read_requests(pdf, "prompt", {"max_tokens": "mt", "seed": "seed"}, SamplingParams(max_tokens=16))
    assert [r[0] for r in requests] == [[1, 2, 3], "hi", [4, 5]]
    assert [r[1].max_tokens for r in requests] == [2, 16, 7]
    assert all(type(r[1].max_tokens) is int for r in requests)
    assert [r[1].seed for r in requests] == [1, None, 3]


def test_caller_errors_raise_at_once(ckpt: Path) -> None:
    pdf = pd.DataFrame({"prompt": ["a"]})
    with pytest.raises(KeyError, match="'text'"):
        generate(pdf, model=ckpt, prompt_column="text")
    with pytest.raises(KeyError, match="'mt'"):
        generate(pdf, model=ckpt, per_row={"max_tokens": "mt"})
    with pytest.raises(TypeError, match="max_token"):
        generate(pdf, model=ckpt, max_token=3)
    with pytest.raises(TypeError, match="kv_cache_byte"):
        generate(pdf, model=ckpt, engine_options={"kv_cache_byte": 1})


def test_meta_inference_loads_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[EngineSpec] = []
    monkeypatch.setattr(EngineSpec, "build", lambda self: builds.append(self))
    pdf = pd.DataFrame({"prompt": ["a b", "c"], "max_tokens": [3, 4]})
    ddf = dd.from_pandas(pdf, npartitions=1)
    out = ddf.map_partitions(generate, model="/no/such/model", per_row={"max_tokens": "max_tokens"})
    assert builds == []
    assert list(out.columns) == [*pdf.columns, *OUTPUT_COLUMNS]
    assert out.dtypes["num_generated_tokens"] == np.int64
    assert out.dtypes["generated_text"] == pd.Series(["x"]).dtype
    # rows that merely look like dask's fake rows are real data: the model is asked for
    fake = dd.utils.meta_nonempty(ddf._meta)
    monkeypatch.setattr(EngineSpec, "build", lambda self: (_ for _ in ()).throw(LookupError("asked for a model")))
    with pytest.raises(LookupError, match="asked for a model"):
        generate(fake, model="/no/such/model", partition_info={"number": 0, "division": None})
    # an empty partition needs no model either
    assert generate(pdf.iloc[:0], model="/no/such/model").columns.tolist()[-len(OUTPUT_COLUMNS):] == list(OUTPUT_COLUMNS)


def test_threaded_dask_partitions_share_one_engine(ckpt: Path, prompt_ids: list[list[int]],
                                                   reference: Any) -> None:
    pdf = frame(prompt_ids)
    ids = pd.Series([list(p) if isinstance(p, list) else None for p in pdf["prompt"]], index=pdf.index,
                    dtype=pd.ArrowDtype(pa.list_(pa.int64())))
    pdf = pdf.assign(prompt=ids).dropna(subset=["prompt"])  # token-id prompts as a pyarrow list column
    ddf = dd.from_pandas(pdf, npartitions=3, sort=False)
    with dask.config.set(scheduler="threads"):
        out = ddf.map_partitions(generate, model=ckpt, per_row={"max_tokens": "max_tokens"},
                                 engine_options=OPTIONS, **GREEDY).compute()
    assert list(out.index) == list(pdf.index)
    assert out["generated_text"].tolist() == reference([list(p) for p in pdf["prompt"]], pdf["max_tokens"].tolist())
    specs = [s for s in local_host().engines.specs() if s.model == str(ckpt.absolute())]
    assert len(specs) == 1  # one cached engine per (model, options) in this process


def test_a_model_that_cannot_load_raises(tmp_path: Path) -> None:
    from batchgen.errors import ModelLoadError

    pdf = pd.DataFrame({"prompt": ["a", "b"]})
    for _ in range(2):  # the failed engine is not cached: the second call tries again
        with pytest.raises(ModelLoadError):
            generate(pdf, model=tmp_path / "missing")
