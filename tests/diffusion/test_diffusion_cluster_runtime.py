"""Image jobs on the cluster runtime that text jobs use (a real LocalCluster: 2 worker processes x
1 thread, a tiny DiT): partitions on one worker combine into one engine, long partitions
migrate to the idle worker, and a SIGKILLed worker loses and duplicates no image.

Images are compared with diffusers-exact single-engine references to within one 8-bit level:
rows that share a forward with other rows (a different mix after a migration) agree with the
row alone to ~1e-5 (diffusion/models/packed.py), which quantisation can round either way.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("diffusers")

import tiny_diffusion as tiny  # noqa: E402
from distributed import Client, Future, LocalCluster  # noqa: E402
from PIL import Image  # noqa: E402

import batchgen  # noqa: E402
import batchgen.cluster as bc  # noqa: E402
from batchgen.cluster.worker import EXTENSION  # noqa: E402
from batchgen.diffusion import DiffusionEngine, ImageRequest  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.build_dit(tmp_path_factory.mktemp("dit-runtime") / "dit")


@pytest.fixture(scope="module")
def client(dit: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        bc.connect(client=c, push_interval=0.1)
        out = tmp_path_factory.mktemp("warm")
        # the pipeline loaded on both workers, so that either can take migrated work at once
        c.gather([submit(c, frame(1, 1), dit, out, w) for w in workers(c)])
        yield c


def frame(n: int, steps: int, start: int = 0) -> pd.DataFrame:
    return pd.DataFrame({"class_label": [i % 5 for i in range(start, start + n)],
                         "num_inference_steps": [steps + 7 * i for i in range(n)],
                         "seed": list(range(start, start + n))}, index=pd.RangeIndex(start, start + n))


def submit(client: Client, pdf: pd.DataFrame, model: Path, out: Path, worker: str, loose: bool = False) -> Future:
    return client.submit(batchgen.diffuse, pdf, model=str(model), output_dir=str(out), guidance_scale=1.0,
                         workers=[worker], allow_other_workers=loose, pure=False)


def workers(client: Client) -> list[str]:
    return sorted(client.scheduler_info()["workers"])


def counters(client: Client, worker: str) -> dict[str, int]:
    import dataclasses

    return client.run(lambda dask_worker: dataclasses.asdict(dask_worker.extensions[EXTENSION].host.counters),
                      workers=[worker])[worker]


@pytest.fixture(scope="module")
def reference(dit: Path) -> DiffusionEngine:
    return DiffusionEngine(dit)


def assert_images_match(engine: DiffusionEngine, pdf: pd.DataFrame, out: pd.DataFrame) -> None:
    assert list(out.index) == list(pdf.index)
    assert out["error"].isna().all(), out["error"].dropna().tolist()
    refs = engine.generate([ImageRequest(class_label=int(r.class_label), num_inference_steps=int(r.num_inference_steps),
                                         seed=int(r.seed), guidance_scale=1.0) for r in pdf.itertuples()])
    for path, ref in zip(out["image_path"], refs):
        got = np.asarray(Image.open(path)).astype(int)
        assert np.abs(got - np.asarray(ref).astype(int)).max() <= 1


def test_partitions_on_one_worker_share_its_engine(client: Client, dit: Path, reference: DiffusionEngine,
                                                   tmp_path: Path) -> None:
    one = workers(client)[0]
    parts = [frame(3, 40, start=10 * k) for k in range(2)]
    outs = client.gather([submit(client, p, dit, tmp_path, one) for p in parts])
    for pdf, out in zip(parts, outs):
        assert_images_match(reference, pdf, out)
    host = client.run(lambda dask_worker: (dask_worker.extensions[EXTENSION].host.peak_jobs,
                                           len(dask_worker.extensions[EXTENSION].host.loads())), workers=[one])[one]
    assert host[0] >= 2  # both partitions waited at once on a 1-thread worker: their tasks seceded
    assert host[1] == 1  # ... in one engine


def test_long_image_partitions_migrate_to_the_idle_worker(client: Client, dit: Path, reference: DiffusionEngine,
                                                          tmp_path: Path) -> None:
    busy, idle = workers(client)
    long_part, short = frame(6, 600, start=100), frame(2, 2, start=200)
    before = bc.metrics(client)["migrations"]
    outs = client.gather([submit(client, long_part, dit, tmp_path, busy), submit(client, short, dit, tmp_path, idle)])
    assert_images_match(reference, long_part, outs[0])
    assert_images_match(reference, short, outs[1])
    time.sleep(0.5)  # the last counters arrive with the next pushes
    assert bc.metrics(client)["migrations"] > before
    assert counters(client, busy)["migrated_out"] > 0 and counters(client, idle)["returned"] > 0


def test_worker_killed_mid_image_job_loses_and_duplicates_nothing(client: Client, dit: Path, reference: DiffusionEngine,
                                                                  tmp_path: Path) -> None:
    owner, holder = workers(client)
    long_part, short = frame(6, 700, start=300), frame(2, 2, start=400)
    before = counters(client, owner)
    futures = [submit(client, long_part, dit, tmp_path, owner, loose=True),
               submit(client, short, dit, tmp_path, holder, loose=True)]
    deadline = time.monotonic() + 60
    # kill once the owner has sent trajectories to the holder: they are then in flight to it or
    # running there, and the owner holds their states (killed when the plugin has only ordered
    # the move, the owner may never send them, and nothing is left to recover)
    while counters(client, owner)["migrated_out"] == before["migrated_out"]:
        assert time.monotonic() < deadline and not futures[0].done(), "no trajectory was sent"
        time.sleep(0.02)
    os.kill(client.run(os.getpid, workers=[holder])[holder], signal.SIGKILL)
    outs: list[Any] = client.gather(futures)
    assert_images_match(reference, long_part, outs[0])
    assert_images_match(reference, short, outs[1])
    assert len(set(outs[0]["image_path"])) == len(long_part)  # one image per row, none written twice
    assert counters(client, owner)["recovered"] > before["recovered"]
