"""The simulator predicts a real job: a skewed batch on a 2-worker LocalCluster (processes),
batchgen's balancing on, against `simulate` with a profile calibrated on those same workers.

The figure is printed (pytest -s): predicted / measured batch completion time.
"""
from __future__ import annotations

import time
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from demo_builder import build_demo_model, tokenizer_vocab_size
from distributed import Client, LocalCluster

import batchgen.cluster as bc
from batchgen.policy.balance import BalanceConfig
from batchgen.sim.calibrate import calibrate
from batchgen.sim.cluster import ClusterSimConfig, simulate
from batchgen.sim.cost import FittedCost
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.policies import BatchGen
from batchgen.sim.profiles import FittedProfile
from batchgen.sim.workload import Workload

OPTIONS = {"dtype": "float32", "kv_cache_bytes": 64 << 20}
# 96 rows of up to 128 tokens, sorted long-last in 2 partitions: skewed enough that the balancer
# moves coroutines. (128 rows of up to 192 tokens in three trials took ~25 s of the suite.)
ROWS = 96
LONGEST = 128
BOUND = 0.25
MAX_TRIALS = 4
MIN_SHARE = 0.7  # of a core per worker during the job: below, other jobs had the cores


def _rows(vocab: int) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(5, vocab, int(rng.integers(8, 32))).tolist() for _ in range(ROWS)]
    lengths = np.sort(np.clip(rng.lognormal(3.6, 0.7, ROWS), 8, LONGEST).astype(int))  # long rows last: skew
    return pd.DataFrame({"prompt": pd.Series(prompts, dtype=pd.ArrowDtype(pa.list_(pa.int64()))),
                         "max_tokens": lengths})


def _calibrate(model: str) -> FittedProfile:
    return calibrate(Path(model), quick=True, threads=1, **OPTIONS)


def _average(profiles: list[FittedProfile]) -> FittedProfile:
    """The mean fit of several calibrations (both workers, before and after a job)."""
    keys = profiles[0].coefficients
    mean = {k: float(np.mean([p.coefficients[k] for p in profiles])) for k in keys}
    p = profiles[0]
    return FittedProfile(p.name, p.model, mean, p.kv_capacity_tokens, p.kv_bytes_per_token, p.num_experts,
                         p.top_k, p.num_moe_layers, p.network_bytes_per_s, p.host_bytes_per_s, p.source, p.fit)


def _profile(client: Client, model: str, workers: list[str]) -> list[FittedProfile]:
    """Both workers measured at once (sharing the machine as during the job)."""
    return client.gather([client.submit(_calibrate, model, workers=[w], pure=False) for w in workers])


@pytest.mark.slow
def test_predicted_bct_within_25_percent_of_a_real_two_worker_job(tmp_path: Path) -> None:
    model = str(build_demo_model(tmp_path / "demo", dtype="float32"))
    pdf = _rows(tokenizer_vocab_size(model))
    ddf = dd.from_pandas(pdf, npartitions=2, sort=False)
    lengths = pdf["max_tokens"].to_numpy(dtype=np.int64)
    workload = Workload("honesty", np.array([len(p) for p in pdf["prompt"]], dtype=np.int64), lengths, lengths)
    engine = EngineSimConfig(max_num_seqs=256, max_num_batched_tokens=2048)  # EngineConfig's defaults
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env={"OMP_NUM_THREADS": "1"}) as cluster, Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])
        bc.connect(client=client, balance=BalanceConfig())
        warm = pdf.iloc[:1].assign(max_tokens=2)
        client.gather([client.submit(bc.generate, warm, model=model, per_row={"max_tokens": "max_tokens"},
                                     engine_options=OPTIONS, temperature=0.0, ignore_eos=True, workers=[w], pure=False)
                       for w in workers])
        # A trial is a job between two calibrations, the profile their mean: on 2 shared cores
        # the machine's speed drifts between minutes, so a pair must see the same machine, and
        # the calibration after the job brackets a drift during it. A trial counts only if the
        # workers had their cores during the job (CPU seconds per wall second, both together):
        # with other jobs on the cores the ratio measures their load, not the simulator (under
        # load average 5-8 single trials read 0.40-1.21). The first trial within the bound
        # passes; two trials that had their cores and missed fail.
        trials: list[tuple[float, float, float, int, float]] = []
        before = _profile(client, model, workers)
        while len(trials) < MAX_TRIALS:
            cpu0 = client.run(time.process_time)
            t0 = time.perf_counter()
            out = ddf.map_partitions(bc.generate, model=model, per_row={"max_tokens": "max_tokens"},
                                     engine_options=OPTIONS, temperature=0.0, ignore_eos=True).compute()
            measured = time.perf_counter() - t0
            cpu1 = client.run(time.process_time)
            assert (out["num_generated_tokens"] == out["max_tokens"]).all()
            share = sum(cpu1[w] - cpu0[w] for w in workers) / (len(workers) * measured)
            after = _profile(client, model, workers)
            sim = simulate(workload, FittedCost.build(_average(before + after)), engine, BatchGen(BalanceConfig()),
                           ClusterSimConfig(2, tick_s=0.2))
            trials.append((sim.bct_s / measured, sim.bct_s, measured, sim.migrated_coroutines, share))
            before = after
            if abs(trials[-1][0] - 1) < BOUND or sum(r[4] >= MIN_SHARE for r in trials) >= 2:
                break
        moved = bc.metrics(client).get("migrations", 0)
        bc.disconnect(client)
    ratio, predicted, measured, sim_moved, share = trials[-1]
    print(f"\nhonesty: predicted/measured per trial {', '.join(f'{r[0]:.3f} (cores {r[4]:.2f})' for r in trials)}; "
          f"last: predicted BCT {predicted:.2f} s, measured {measured:.2f} s; migrated coroutines: measured {moved} "
          f"({len(trials)} jobs), simulated {sim_moved} (one)")
    if abs(ratio - 1) >= BOUND and all(r[4] < MIN_SHARE for r in trials):
        pytest.skip(f"the workers never had their cores (CPU per wall second {[round(r[4], 2) for r in trials]}): "
                    "a measured BCT here says how loaded the machine is")
    assert abs(ratio - 1) < BOUND, trials
