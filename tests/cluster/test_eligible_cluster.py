"""A mixed cluster: three CPU worker processes, two carrying the Dask resource `GPU`. With
`worker_resource="GPU"` an ETL pipeline (Parquet in, clean, batchgen.generate, Parquet out)
runs on all three, the third hands its partitions' rows to the other two and never loads a
model nor adopts a migrated row; the output is complete and the same as without the third
worker. A cluster where no worker qualifies fails the job at once, naming the resource.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dask.dataframe as dd
import pandas as pd
import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster

import batchgen.cluster as bc
from batchgen.cluster.worker import EXTENSION
from batchgen.errors import BatchgenError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

OPTIONS = {"kv_cache_bytes": 16 << 20}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
TEXTS = ["The quick brown fox", "def f(x):", "a", "Hello, world!", "x = 1\ny = 2", "import os", "# note", "if"]


def _worker(resources: dict[str, float] | None) -> dict[str, Any]:
    return {"cls": Nanny, "options": {"nthreads": 1, "resources": resources or {},
                                      "env": {"OMP_NUM_THREADS": "1"}}}


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory: Callable[..., Path]) -> Path:
    return checkpoint_factory("mixtral")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SpecCluster]:
    spec = {"gpu-a": _worker({"GPU": 1}), "gpu-b": _worker({"GPU": 1}), "cpu-c": _worker(None)}
    with SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}}) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: SpecCluster) -> Iterator[Client]:
    with Client(cluster) as c:
        c.wait_for_workers(3, timeout=120)
        bc.connect(client=c, push_interval=0.1, worker_resource="GPU")
        yield c


def by_name(client: Client, expected: tuple[str, ...] = ("gpu-a", "gpu-b", "cpu-c")) -> dict[str, str]:
    """Worker name -> address, once every expected name is registered (within 60 s): a worker its
    nanny restarts is away for a moment, then back under its name at a new address."""
    deadline = time.monotonic() + 60
    while True:
        names = {w["name"]: addr for addr, w in client.scheduler_info()["workers"].items()}
        if set(expected) <= set(names) or time.monotonic() > deadline:
            return names
        time.sleep(0.2)


def pipeline(src: Path, dst: Path, ckpt: Path) -> pd.DataFrame:
    """Read Parquet, clean, generate, write Parquet; -> the written rows, by index."""
    def clean(pdf: pd.DataFrame) -> pd.DataFrame:
        from distributed import get_worker

        out = pdf.assign(prompt=pdf["prompt"].str.strip())
        out = out[out["prompt"].str.len() > 0]
        return out.assign(cleaned_on=pd.Series(get_worker().name, index=out.index, dtype="string"))

    ddf = dd.read_parquet(src)
    meta = ddf._meta.assign(cleaned_on=pd.Series(dtype="string"))
    cleaned = ddf.map_partitions(clean, meta=meta)
    out = cleaned.map_partitions(bc.generate, model=ckpt, per_row={"max_tokens": "max_tokens"},
                                 engine_options=OPTIONS, **GREEDY)
    out.to_parquet(dst, write_index=True)
    return pd.read_parquet(dst).sort_index()


def state_of(client: Client, worker: str) -> dict[str, Any]:
    def probe(dask_worker: Any) -> dict[str, Any]:
        host = dask_worker.extensions[EXTENSION].host
        return {"engines": [s.key for s in host.engines.specs()], "migrated_in": host.counters.migrated_in,
                "submitted_in": host.counters.submitted_in, "delegated": host.counters.delegated,
                "engine_module": "batchgen.engine" in sys.modules, "torch": "torch" in sys.modules}
    return client.run(probe, workers=[worker])[worker]


def plugin_records(client: Client) -> dict[str, Any]:
    def read(dask_scheduler: Any) -> dict[str, Any]:
        plugin = dask_scheduler.plugins["batchgen-balance"]
        return {"engines": {w: sorted(v.report.get("engines", {})) for w, v in plugin.views.items()},
                "orders": [(o.src, o.dst) for _, o in plugin.log]}
    return client.run_on_scheduler(read)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pd.DataFrame]:
    n = 48
    prompts = [f"  {TEXTS[i % len(TEXTS)]} {i} " if i % 11 else "   " for i in range(n)]  # some clean to nothing
    pdf = pd.DataFrame({"prompt": prompts, "max_tokens": [3 + (5 * i) % 9 for i in range(n)]})
    path = tmp_path_factory.mktemp("etl") / "in"
    dd.from_pandas(pdf, npartitions=12).to_parquet(path)
    return path, pdf


def test_model_replicas_go_only_to_resource_workers(client: Client, ckpt: Path) -> None:
    from batchgen.moa.pool import Item, ModelPool
    from batchgen.sampling_params import SamplingParams

    names = by_name(client)
    pool = ModelPool({"m": ckpt}, client=client, placement="data_parallel", engine_options=OPTIONS)
    assert sorted(w.name for w in pool.workers()) == sorted([names["gpu-a"], names["gpu-b"]])
    items = [Item(i, "m", f"row {i}", SamplingParams(max_tokens=2)) for i in range(8)]
    placement = pool.plan(items)
    assert set(placement.replicas["m"]) == {names["gpu-a"], names["gpu-b"]}
    pool.close()  # unpins the model


def test_only_resource_workers_load_the_model(client: Client, ckpt: Path, source: tuple[Path, pd.DataFrame],
                                              tmp_path: Path) -> None:
    names = by_name(client)
    cpu = names["cpu-c"]
    src, pdf = source
    out = pipeline(src, tmp_path / "mixed", ckpt)

    kept = pdf[pdf["prompt"].str.strip().str.len() > 0]
    assert list(out.index) == list(kept.index)  # complete: every cleaned row, once
    assert out["error"].isna().all() and (out["num_generated_tokens"] == out["max_tokens"]).all()
    assert "cpu-c" in set(out["cleaned_on"])  # the third worker ran part of the pipeline

    third = state_of(client, cpu)
    assert third["delegated"] > 0  # its partitions' rows went to the GPU workers...
    assert third["engines"] == [] and not third["engine_module"] and not third["torch"]  # ...no model here
    assert third["migrated_in"] == 0 and third["submitted_in"] == 0
    for name in ("gpu-a", "gpu-b"):
        assert state_of(client, names[name])["engines"]  # the model loaded where it may
    records = plugin_records(client)
    assert records["engines"].get(cpu, []) == []
    assert all(cpu not in pair for pair in records["orders"])  # never a migration source or target

    # the same job without the third worker: the same rows, the same text (greedy fp32)
    client.retire_workers([cpu], close_workers=True, remove=True)
    deadline = time.monotonic() + 60
    while cpu in client.scheduler_info()["workers"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cpu not in client.scheduler_info()["workers"]
    alone = pipeline(src, tmp_path / "two", ckpt)
    assert set(alone["cleaned_on"]) <= {"gpu-a", "gpu-b"}
    cols = ["prompt", "generated_text", "num_generated_tokens", "finish_reason"]
    pd.testing.assert_frame_equal(out[cols], alone[cols])


def test_no_eligible_worker_fails_fast_naming_the_resource(client: Client, ckpt: Path) -> None:
    assert bc.install(client, worker_resource="TPU") is True  # nobody has it
    try:
        pdf = pd.DataFrame({"prompt": ["hello", "world"], "max_tokens": [4, 4]})
        ddf = dd.from_pandas(pdf, npartitions=1)
        t0 = time.monotonic()
        with pytest.raises(BatchgenError, match="'TPU'"):
            ddf.map_partitions(bc.generate, model=ckpt, per_row={"max_tokens": "max_tokens"},
                               engine_options=OPTIONS, **GREEDY).compute()
        assert time.monotonic() - t0 < 30  # no engine load, no wait for one
        assert all(not state_of(client, w)["engines"] for w in client.scheduler_info()["workers"])
    finally:
        bc.install(client, worker_resource="GPU")
