"""MoA on a real 2-worker LocalCluster (processes) with 4 tiny models of three families:
every proposer answer equals that model alone (greedy), the bypass skips exactly the rows at or
above the threshold, engines sit where the placement put them, a killed worker loses nothing."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from distributed import Client, LocalCluster

import batchgen.cluster as bc
from batchgen import Engine, SamplingParams
from batchgen.cluster.worker import EXTENSION
from batchgen.moa import MoA
from batchgen.moa.pinning import pinned

pytestmark = pytest.mark.slow  # a real LocalCluster of worker processes


OPTIONS = {"kv_cache_bytes": 16 << 20}
TEXTS = ["The quick brown fox", "def f(x):", "a", "Hello, world!", "x = 1\ny = 2", "import os", "# note", "if",
         "class A:", "return None", "for i in", "while True"]


def first_word(text: str) -> str | None:
    words = text.split()
    return words[0] if words else None


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import tiny_models

    root = tmp_path_factory.mktemp("moa")
    built = {"llama": tiny_models.build_checkpoint("llama", root / "llama", seed=1),
             "twin": tiny_models.build_checkpoint("llama", root / "twin", seed=1),  # same weights: agrees
             "qwen": tiny_models.build_checkpoint("qwen2", root / "qwen", seed=2),
             "small": tiny_models.build_checkpoint("llama", root / "small", seed=3, hidden_size=32,
                                                   intermediate_size=64, num_hidden_layers=2)}
    return built


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        bc.connect(client=c, push_interval=0.1)
        yield c


@pytest.fixture(scope="module")
def alone(models: dict[str, Path]) -> Callable[[str, list, SamplingParams], list[str]]:
    engines: dict[str, Engine] = {}

    def run(name: str, prompts: list, params: SamplingParams) -> list[str]:
        if name not in engines:
            engines[name] = Engine(models[name], **OPTIONS)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [o.text for o in engines[name].generate(prompts, params)]
        finally:
            torch.set_num_threads(threads)
    return run


def frame(n: int) -> pd.DataFrame:
    routes = [["llama", "twin", "qwen"], ["llama", "qwen", "small"], ["twin", "small", "llama"]]
    return pd.DataFrame({"prompt": [TEXTS[i % len(TEXTS)] + f" {i}" for i in range(n)],
                         "experts": [routes[i % 3] for i in range(n)]}, index=pd.RangeIndex(100, 100 + n))


def make_job(models: dict[str, Path], client: Client, **kw) -> MoA:
    sampling = {"llama": {"max_tokens": 4}, "twin": {"max_tokens": 4}, "qwen": {"max_tokens": 8},
                "small": {"max_tokens": 2}}
    kw = {"sampling": sampling, "skip_threshold": 0.6, **kw}
    return MoA(models, aggregator="qwen", route="experts", k=3, extract=first_word,
               default_sampling={"temperature": 0.0, "ignore_eos": True}, client=client, engine_options=OPTIONS,
               rows_per_task=4, chat=False, **kw)


def check_answers(out: pd.DataFrame, pdf: pd.DataFrame, job: MoA, alone: Callable) -> None:
    for name in job.proposers:
        mask = pdf["experts"].map(lambda e, n=name: n in e)
        prompts = pdf.loc[mask, "prompt"].tolist()
        assert out.loc[mask, f"{name}_text"].tolist() == alone(name, prompts, job.sampling[name]), name
        assert out.loc[~mask, f"{name}_text"].isna().all()
    conf = out["confidence"].astype(float)
    assert (out["aggregated"] == (conf < 0.6)).all()  # skipped: exactly the rows at or above the threshold
    assert job.stats.rows_skipped == int((conf >= 0.6).sum()) and job.stats.rows_aggregated == int((conf < 0.6).sum())
    assert out["error"].isna().all() and out["final_text"].notna().all()


def test_moa_answers_equal_each_model_alone(client: Client, models: dict[str, Path], alone: Callable) -> None:
    pdf = frame(12)
    job = make_job(models, client)
    out = job.generate(pdf)
    assert list(out.index) == list(pdf.index)
    check_answers(out, pdf, job, alone)
    assert 0 < job.stats.rows_skipped < 12  # the twins agree; the other rows do not all agree
    # aggregated rows: the aggregator alone on the prompt with the answers injected
    agg = out[out["aggregated"]]
    for _idx, row in agg.iterrows():
        refs = [row[f"{n}_text"] for n in row["experts"]]
        want = alone("qwen", [job._prompt("qwen", row["prompt"], refs)], job.sampling["qwen"])[0]
        assert row["final_text"] == want
    s = job.stats
    assert s.total_s >= s.expert_stage_s > 0 and s.aggregator_stage_s > 0 and "ilp" in s.placement
    # engines only where the placement put them, and the pins removed at the end
    plan = s.placements[0]
    held = client.run(lambda dask_worker: sorted(Path(r.spec.model).name
                                                 for r in dask_worker.extensions[EXTENSION].host.engines.live()))
    for name, workers in plan.replicas.items():
        for w in held:
            assert (name in held[w]) == (w in workers) or name == "qwen", (name, held, plan.replicas)
    assert pinned(client) == {}


def test_always_aggregate_and_unknown_route(client: Client, models: dict[str, Path], alone: Callable) -> None:
    pdf = frame(6)
    pdf.loc[101, "experts"] = ["llama", "nobody"]
    pdf.loc[102, "prompt"] = ""
    job = make_job(models, client, skip_threshold=float("inf"), placement="round_robin")
    out = job.generate(pdf)
    assert "nobody" in out.loc[101, "error"] and pd.isna(out.loc[101, "final_text"])
    assert "prompt=''" in out.loc[102, "error"] and pd.isna(out.loc[102, "final_text"])
    good = out.drop(index=[101, 102])
    assert good["aggregated"].all() and good["error"].isna().all()
    assert job.stats.rows_skipped == 0 and job.stats.rows_aggregated == 4


def test_second_layer_reads_the_first_layers_answers(client: Client, models: dict[str, Path],
                                                      alone: Callable) -> None:
    pdf = frame(6)
    job = make_job(models, client, layers=2, skip_threshold=float("inf"))
    out = job.generate(pdf)
    assert out["error"].isna().all()
    for idx, row in out.iterrows():
        first = {n: alone(n, [row["prompt"]], job.sampling[n])[0] for n in row["experts"]}
        for n in row["experts"]:  # layer 2: the model on the row's prompt with the layer-1 answers injected
            want = alone(n, [job._prompt(n, row["prompt"], [first[m] for m in row["experts"]])], job.sampling[n])[0]
            assert row[f"{n}_text"] == want, (idx, n)
        refs = [row[f"{n}_text"] for n in row["experts"]]  # the aggregator sees the last layer's answers
        assert row["final_text"] == alone("qwen", [job._prompt("qwen", row["prompt"], refs)], job.sampling["qwen"])[0]


def test_aggregator_starts_while_proposers_still_run(client: Client, models: dict[str, Path]) -> None:
    # half the rows ask only the 2-token model and its quick peers; the others also a 96-token one
    pdf = pd.DataFrame({"prompt": [TEXTS[i % len(TEXTS)] + f" {i}" for i in range(16)],
                        "experts": [["small", "twin"] if i % 2 else ["llama", "twin"] for i in range(16)]})
    sampling = {"llama": {"max_tokens": 96}, "twin": {"max_tokens": 2}, "qwen": {"max_tokens": 2},
                "small": {"max_tokens": 2}}
    job = make_job(models, client, sampling=sampling, skip_threshold=float("inf"))
    job.generate(pdf)
    s = job.stats
    # the aggregator's first row went out before the last proposer answer came back:
    # its first submission = (its last output - aggregator_stage_s) <= total_s - aggregator_stage_s
    assert s.rows_aggregated == 16
    assert s.total_s - s.aggregator_stage_s < s.expert_stage_s, s


def test_worker_killed_mid_job_loses_nothing(client: Client, models: dict[str, Path], alone: Callable) -> None:
    client.wait_for_workers(2, timeout=180)
    pdf = frame(12)
    sampling = {"llama": {"max_tokens": 48}, "twin": {"max_tokens": 48}, "qwen": {"max_tokens": 64},
                "small": {"max_tokens": 24}}
    job = make_job(models, client, sampling=sampling)
    result: dict[str, pd.DataFrame] = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", job.generate(pdf)))
    thread.start()
    deadline = time.monotonic() + 180  # generous: the shared machine can be very busy
    while not job.stats.placements:  # the placement is made: tasks are going out
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.5)  # engines loaded and generating
    victim = sorted(client.scheduler_info()["workers"])[-1]
    os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    thread.join(timeout=600)
    assert not thread.is_alive()
    out = result["out"]
    assert list(out.index) == list(pdf.index)
    check_answers(out, pdf, job, alone)


def test_generate_with_model_column_on_dask(client: Client, models: dict[str, Path], alone: Callable) -> None:
    import dask.dataframe as dd

    import batchgen

    pdf = pd.DataFrame({"prompt": TEXTS[:6], "model": ["llama", "qwen", "small", "qwen", "ghost", "llama"]})
    ddf = dd.from_pandas(pdf, npartitions=2)
    out = ddf.map_partitions(batchgen.generate, model={n: str(models[n]) for n in ("llama", "qwen", "small")},
                             model_column="model", max_tokens=3, temperature=0.0, ignore_eos=True,
                             engine_options=OPTIONS).compute()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for _i, row in out.iterrows():
        if row["model"] == "ghost":
            assert row["finish_reason"] == "error" and "unknown model" in row["error"]
        else:
            assert row["generated_text"] == alone(row["model"], [row["prompt"]], params)[0]


def test_worker_close_leaves_the_extensions_dict_alone() -> None:
    """distributed's Worker.close awaits each extension's close() while iterating
    worker.extensions; batchgen's deleted its entry there ("dictionary changed size during
    iteration" at every cluster shutdown, and the nanny killing the worker after 4 s)."""
    import asyncio
    import types

    from batchgen.cluster.worker import ensure_side

    worker = types.SimpleNamespace(handlers={}, extensions={"other": object()}, address="tcp://127.0.0.1:1")
    side = ensure_side(worker)
    assert worker.extensions[EXTENSION] is side and "batchgen_adopt" in worker.handlers

    async def close_as_dask_does() -> None:
        for extension in worker.extensions.values():
            if hasattr(extension, "close"):
                await extension.close()

    asyncio.run(close_as_dask_does())
    assert "batchgen_adopt" not in worker.handlers
