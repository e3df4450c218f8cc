"""Chat rows in DataFrames: batchgen.generate(messages_column=...) with chat_template_kwargs,
against transformers' apply_chat_template + greedy generate, on a Qwen3-MoE-shaped tiny
checkpoint whose template honours `enable_thinking` (as Qwen3's does)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pytest
from distributed import Client, LocalCluster
from tiny_models import build_thinking_checkpoint, reference_generate
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import batchgen
from batchgen.cluster.spec import EngineSpec

CONVERSATIONS = [
    [{"role": "user", "content": "alpha beta gamma"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three four"}],
    [{"role": "user", "content": "x = 1\ny = 2"}],
]
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
OPTIONS = {"kv_cache_bytes": 16 << 20}
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 5, "logprobs": 1}
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_checkpoint(tmp_path_factory.mktemp("qwen3-thinking"))


def oracle(model: Path, conversations: list[Any], max_tokens: int = 5, **kwargs: Any) -> list[list[int]]:
    """transformers' rendering and greedy generate, one conversation at a time."""
    tok = AutoTokenizer.from_pretrained(str(model))
    outs = []
    for c in conversations:
        ids = tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True, **kwargs)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        outs.append(reference_generate(model, ids, max_tokens, ignore_eos=True))
    return outs


def cell_forms(conversations: list[Any]) -> dict[str, pd.Series]:
    """The three ways a messages cell arrives: pandas objects, pyarrow list<struct>, JSON text."""
    return {"objects": pd.Series(conversations, dtype=object),
            "arrow": pd.Series(conversations, dtype=pd.ArrowDtype(MESSAGES)),
            "json": pd.Series([json.dumps(c) for c in conversations])}


def pieces(model: Path, ids: list[list[int]]) -> list[list[str]]:
    """Each token as its own text: what the logprobs column's `token` holds, token by token."""
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return [[tok.decode([t], skip_special_tokens=False) for t in row] for row in ids]


def generated(out: pd.DataFrame, prefix: str = "") -> list[list[str]]:
    """The generated tokens of each row, from the logprobs column (asked for with logprobs=1)."""
    return [[e["token"] for e in row] for row in out[prefix + "logprobs"].tolist()]


@pytest.mark.parametrize("form", ["objects", "arrow", "json"])
def test_messages_in_every_cell_form_equal_transformers(qwen3: Path, form: str) -> None:
    pdf = pd.DataFrame({"messages": cell_forms(CONVERSATIONS)[form], "k": range(4)}).set_axis([7, 3, 11, 5])
    out = batchgen.generate(pdf, model=qwen3, messages_column="messages", chat_template_kwargs=OFF,
                            engine_options=OPTIONS, **GREEDY)
    assert list(out.index) == [7, 3, 11, 5] and out["error"].isna().all()
    assert generated(out) == pieces(qwen3, oracle(qwen3, CONVERSATIONS, **OFF))


def test_per_row_chat_template_kwargs_override_the_job(qwen3: Path) -> None:
    pdf = pd.DataFrame({"messages": cell_forms(CONVERSATIONS[:2])["arrow"],
                        "tmpl": pd.Series([None, json.dumps({"enable_thinking": True})])})
    out = batchgen.generate(pdf, model=qwen3, messages_column="messages", chat_template_kwargs=OFF,
                            per_row={"chat_template_kwargs": "tmpl"}, engine_options=OPTIONS, **GREEDY)
    expected = [oracle(qwen3, CONVERSATIONS[:1], **OFF)[0], oracle(qwen3, CONVERSATIONS[1:2])[0]]
    assert generated(out) == pieces(qwen3, expected)
    tok = AutoTokenizer.from_pretrained(str(qwen3))
    on = tok.apply_chat_template(CONVERSATIONS[1], tokenize=True, add_generation_prompt=True)
    assert out["num_input_tokens"].tolist()[1] == len(on["input_ids"] if hasattr(on, "keys") else on)


def test_malformed_messages_fail_alone_naming_row_and_field(qwen3: Path) -> None:
    good = CONVERSATIONS[0]
    cells: list[Any] = [
        good,
        "{not json",                                       # 1 text that is no JSON
        json.dumps({"role": "user", "content": "x"}),      # 2 not a list
        [],                                                # 3 an empty list
        ["hello"],                                         # 4 a message that is no object
        [{"content": "no role"}],                          # 5 no role
        [{"role": "user"}],                                # 6 no content
        [{"role": "user", "content": {"a": 1}}],           # 7 content neither text nor text parts
        [{"role": "tool", "content": "x"}],                # 8 a role the template rejects
        None,                                              # 9 a null cell
        good,
    ]
    pdf = pd.DataFrame({"conv": pd.Series(cells, dtype=object)})
    out = batchgen.generate(pdf, model=qwen3, messages_column="conv", engine_options=OPTIONS, **GREEDY)
    reasons = out["finish_reason"].tolist()
    assert reasons == ["length"] + ["error"] * 9 + ["length"]
    errors = out["error"].tolist()
    expected = {1: "conv: not valid JSON", 2: "conv must be a non-empty list", 3: "conv must be a non-empty list",
                4: "conv[0] must be an object with a string 'role'", 5: "conv[0] must be an object with a string 'role'",
                6: "conv[0].content must be a string", 7: "conv[0].content must be a string",
                8: "unknown role tool", 9: "conv: missing (null)"}
    for row, text in expected.items():
        assert errors[row].startswith(f"row {row}: ") and text in errors[row], errors[row]
    assert out["generated_text"].tolist()[0] == out["generated_text"].tolist()[10] != ""
    assert generated(out.iloc[[0]]) == pieces(qwen3, oracle(qwen3, [good]))
    assert out["logprobs"].isna().tolist() == [False] + [True] * 9 + [False]
    assert (out["num_generated_tokens"].tolist()[1:10], out["num_input_tokens"].tolist()[1:10]) == ([0] * 9, [0] * 9)


def test_model_column_with_chat_rows(qwen3: Path) -> None:
    pdf = pd.DataFrame({"messages": cell_forms(CONVERSATIONS[:3])["json"], "which": ["a", "nope", "b"]})
    out = batchgen.generate(pdf, model={"a": qwen3, "b": qwen3}, model_column="which", messages_column="messages",
                            chat_template_kwargs=OFF, engine_options=OPTIONS, **GREEDY)
    assert out["finish_reason"].tolist() == ["length", "error", "length"]
    assert "which='nope': unknown model" in out["error"][1]
    assert generated(out.iloc[[0, 2]]) == pieces(qwen3, oracle(qwen3, [CONVERSATIONS[0], CONVERSATIONS[2]], **OFF))


def test_caller_errors_raise_before_any_work(qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EngineSpec, "build", lambda self: pytest.fail("an engine was built"))
    pdf = pd.DataFrame({"messages": cell_forms(CONVERSATIONS[:1])["json"], "error": ["mine"]})
    with pytest.raises(ValueError, match=r"\['error'\].*output_prefix="):
        batchgen.generate(pdf, model=qwen3, messages_column="messages")
    with pytest.raises(ValueError, match=r"\['logprobs'\].*output_prefix="):
        batchgen.generate(pdf.rename(columns={"error": "logprobs"}), model=qwen3, messages_column="messages",
                          logprobs=1)
    with pytest.raises(KeyError, match="messages_column 'chat'"):
        batchgen.generate(pdf, model=qwen3, messages_column="chat", output_prefix="out_")
    with pytest.raises(TypeError, match=r"chat_template_kwargs=\[1\]: must be an object"):
        batchgen.generate(pdf, model=qwen3, messages_column="messages", chat_template_kwargs=[1],  # type: ignore[arg-type]
                          output_prefix="out_")
    with pytest.raises(TypeError, match="needs messages_column"):
        batchgen.generate(pdf.assign(prompt="x"), model=qwen3, chat_template_kwargs=OFF, output_prefix="out_")


def test_output_prefix_names_every_column(qwen3: Path) -> None:
    pdf = pd.DataFrame({"messages": cell_forms(CONVERSATIONS[:1])["arrow"], "error": ["mine"]})
    out = batchgen.generate(pdf, model=qwen3, messages_column="messages", output_prefix="out_",
                            engine_options=OPTIONS, **GREEDY)
    assert list(out.columns) == ["messages", "error", "out_generated_text", "out_finish_reason", "out_error",
                                 "out_num_input_tokens", "out_num_generated_tokens", "out_num_cached_tokens",
                                 "out_logprobs"]
    assert out["error"].tolist() == ["mine"] and out["out_num_generated_tokens"].tolist() == [5]


def test_meta_is_inferred_without_a_model_and_equals_output_meta(qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EngineSpec, "build", lambda self: pytest.fail("an engine was built"))
    pdf = pd.DataFrame({"messages": cell_forms(CONVERSATIONS)["arrow"], "n": range(4)})
    ddf = dd.from_pandas(pdf, npartitions=2)
    kwargs: dict[str, Any] = dict(model="/no/such/model", messages_column="messages", logprobs=2, output_prefix="o_")
    inferred = ddf.map_partitions(batchgen.generate, **kwargs)
    given = batchgen.output_meta(ddf, **kwargs)
    assert list(inferred.columns) == list(given.columns) and given.empty
    assert inferred.dtypes.to_dict() == given.dtypes.to_dict()
    assert str(given.dtypes["o_logprobs"]).startswith("list<item: struct<token: string, logprob: double, "
                                                      "top_logprobs: list<item: struct<token: string")
    fake = dd.utils.meta_nonempty(ddf._meta)  # dask's placeholder rows (the messages are null)
    assert batchgen.generate(fake, **kwargs)["o_finish_reason"].tolist() == ["length", "length"]  # the schema answer
    # the same rows handed over with partition_info are a real partition: each row is judged
    real = batchgen.generate(fake, partition_info={"number": 0, "division": None}, **{**kwargs, "model": qwen3})
    assert real["o_finish_reason"].tolist() == ["error", "error"]
    assert all("messages: missing (null)" in e for e in real["o_error"])


def test_threaded_dask_with_explicit_meta(qwen3: Path) -> None:
    pdf = pd.DataFrame({"messages": cell_forms(CONVERSATIONS)["json"]})
    ddf = dd.from_pandas(pdf, npartitions=2)
    kwargs: dict[str, Any] = dict(model=qwen3, messages_column="messages", chat_template_kwargs=OFF,
                                  engine_options=OPTIONS, **GREEDY)
    with dask.config.set(scheduler="threads"):
        out = ddf.map_partitions(batchgen.generate, **kwargs, meta=batchgen.output_meta(ddf, **kwargs)).compute()
        lazy = batchgen.cluster.generate_dataframe(ddf, **kwargs)  # the same, with every option checked at once
        assert list(lazy.columns) == list(out.columns)
        assert lazy.compute()["generated_text"].tolist() == out["generated_text"].tolist()
    assert generated(out) == pieces(qwen3, oracle(qwen3, CONVERSATIONS, **OFF))
    with pytest.raises(KeyError, match="messages_column 'nope'"):
        batchgen.cluster.generate_dataframe(ddf, **{**kwargs, "messages_column": "nope"})


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        batchgen.cluster.connect(client=c, push_interval=0.1)
        yield c


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_map_partitions_on_a_local_cluster_equals_transformers(client: Client, qwen3: Path) -> None:
    client.wait_for_workers(2, timeout=60)
    conversations = CONVERSATIONS * 2
    expected = pieces(qwen3, oracle(qwen3, conversations, **OFF))
    for form, cells in cell_forms(conversations).items():
        ddf = dd.from_pandas(pd.DataFrame({"messages": cells, "row": range(len(cells))}), npartitions=4)
        out = ddf.map_partitions(batchgen.generate, model=qwen3, messages_column="messages",
                                 chat_template_kwargs=OFF, engine_options=OPTIONS, **GREEDY).compute()
        assert out["error"].isna().all(), (form, out["error"].tolist())
        assert out["row"].tolist() == list(range(len(cells)))
        assert generated(out) == expected, form
