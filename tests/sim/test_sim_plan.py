"""`batchgen plan`: output shape, bounds, determinism, bad input (exit 2), and that balancing
decisions are plan_migrations' own on the simulated state."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import batchgen.policy.balance as balance
from batchgen.cli import main
from batchgen.errors import PlanError
from batchgen.sim import cluster as sim_cluster
from batchgen.sim.cluster import PLUGIN_COOLDOWN_S, ClusterSimConfig, simulate
from batchgen.sim.cost import ExpertTiers, build_cost, experts_touched
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.planner import ideal_bound, run_plan
from batchgen.sim.policies import DEFAULT_POLICIES, BatchGen
from batchgen.sim.profiles import BUILTIN_PROFILES, GpuProfile, load_profile
from batchgen.sim.shapes import BUILTIN_MODELS, load_shape
from batchgen.sim.workload import load_lengths, synthetic

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def h200():
    return build_cost(load_profile("H200"), load_shape("qwen3-30b-a3b"))


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_exactly_the_documented_shape(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan_json(capsys, "--rows", "300", "--workers", "4", "--profile", "H200")
    assert set(out) == {"policies", "ideal_bct_s"}
    assert set(out["policies"]) == {"static", "dynamic", "batchgen"}
    for numbers in out["policies"].values():
        assert set(numbers) == {"bct_s", "gpu_hours", "utilization"}
        assert numbers["bct_s"] >= out["ideal_bct_s"] > 0  # the bound bounds
        assert numbers["gpu_hours"] == pytest.approx(4 * numbers["bct_s"] / 3600)
        assert 0 < numbers["utilization"] <= 1


def test_table_and_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--rows", "100", "--workers", "2", "--profile", "h100", "--sweep-workers", "2,4"]) == 0
    text = capsys.readouterr().out
    assert "[simulated]" in text and "batchgen speedup" in text
    sweep = text.split("sweep (simulated)")[1].splitlines()
    assert [line.split()[0] for line in sweep[2:]] == ["2", "4"]


@pytest.mark.parametrize("seed", [0, 1])
def test_no_policy_beats_the_ideal_bound_and_runs_repeat_exactly(h200, seed: int) -> None:
    w = synthetic("reasoning", 240, seed)
    a = run_plan(w, h200, EngineSimConfig(), ClusterSimConfig(6))
    b = run_plan(w, h200, EngineSimConfig(), ClusterSimConfig(6))
    for ra, rb in zip(a.results, b.results):
        assert ra.bct_s >= a.ideal.bct_s
        assert (ra.bct_s, ra.busy_s, ra.migrated_coroutines) == (rb.bct_s, rb.busy_s, rb.migrated_coroutines)
        assert ra.rows_done == 240


def test_balancing_orders_are_plan_migrations_on_the_same_state(h200, monkeypatch: pytest.MonkeyPatch) -> None:
    plans: list[tuple[list, list]] = []
    done: list[tuple[int, object]] = []  # (index of the plan it came from, order)

    def recording(loads, config=None, *, arriving=False):  # type: ignore[no-untyped-def]
        loads = list(loads)
        orders = balance.plan_migrations(loads, config, arriving=arriving)
        plans.append((loads, orders))
        return orders

    carry_out = sim_cluster._Balancer._carry_out

    def carried(self, order, now):  # type: ignore[no-untyped-def]
        done.append((len(plans) - 1, order))
        return carry_out(self, order, now)

    monkeypatch.setattr(sim_cluster, "plan_migrations", recording)
    monkeypatch.setattr(sim_cluster._Balancer, "_carry_out", carried)
    w = synthetic("reasoning", 300, 0, order="sorted")  # skewed: the last worker gets the longest rows
    result = simulate(w, h200, EngineSimConfig(), BatchGen(), ClusterSimConfig(4, tick_s=2.0))
    assert done, "a sorted workload must make the balancer act"
    for loads, got in plans:
        assert balance.plan_migrations(loads, BatchGen().balance) == got
        assert {x.worker for x in loads} <= {f"sim-worker-{i:04d}" for i in range(4)}
    for index, order in done:  # every order carried out is one the policy gave on the latest views
        assert order in plans[index][1]
    assert result.migration_orders == len(done)
    assert result.migrated_coroutines == sum(len(o.seq_ids) for _, o in done)  # type: ignore[attr-defined]


def test_length_oblivious_estimate_lies_between_the_bound_and_the_policies(h200) -> None:
    """oblivious_bct grants free, perfect migration but starts rows in an order blind to their
    lengths: above the ideal bound when rows start late, and close under every simulated policy."""
    from batchgen.sim.oblivious import fifo_bct, oblivious_bct, start_orders

    assert [list(o) for o in start_orders(7, 3)] == [list(range(7)), [0, 3, 5, 1, 4, 6, 2]]
    w = synthetic("reasoning", 400, 0)
    engine = EngineSimConfig(max_num_seqs=16)
    report = run_plan(w, h200, engine, ClusterSimConfig(3))
    est = oblivious_bct(w, h200, engine, 3)
    assert est > 1.02 * report.ideal.bct_s  # rows must wait for seats, so late long ones cost time
    for r in report.results:
        assert r.bct_s > 0.98 * est, r.policy
    # long rows first: the blind order is the worst one, long rows last in input order even more so
    longest_first = np.argsort(-w.output_len, kind="stable")
    assert fifo_bct(w, h200, engine, 3, longest_first) < est
    assert fifo_bct(w, h200, engine, 3, longest_first[::-1]) > est


def test_length_aware_estimates_split_the_pools_as_asked(h200) -> None:
    """isolated_bct is the later of two length_aware_bct runs: the long rows on their own
    workers, the rest on the others; with none isolated it is length_aware_bct itself."""
    from batchgen.sim.oblivious import fifo_bct, isolated_bct, length_aware_bct

    w = synthetic("reasoning", 300, 1)
    engine = EngineSimConfig(max_num_seqs=16)
    aware = length_aware_bct(w, h200, engine, 4)
    longest_first = np.argsort(-w.output_len, kind="stable")
    assert aware == fifo_bct(w, h200, engine, 4, longest_first)
    assert isolated_bct(w, h200, engine, 4, 10**9, 2) == aware  # no row that long
    assert isolated_bct(w, h200, engine, 4, 1, 0) == aware
    cut = int(np.sort(w.output_len)[-10])
    m = w.output_len >= cut
    parts = [length_aware_bct(w.take(k), h200, engine, n) for k, n in ((m, 1), (~m, 3))]
    assert isolated_bct(w, h200, engine, 4, cut, 1) == pytest.approx(max(parts))
    with pytest.raises(ValueError, match="isolated_workers"):
        isolated_bct(w, h200, engine, 4, cut, 4)


def test_tail_need_never_rules_out_what_a_simulated_policy_achieved(h200) -> None:
    """tail_need is a lower bound: every simulated policy's BCT passes it, and tail_bound lies at
    or under the best of them; with many long rows on few workers it binds above ideal_bound."""
    from batchgen.sim.oblivious import tail_bound, tail_need
    from batchgen.sim.workload import Workload

    long, short = 24, 300
    w = Workload("t", np.array([200] * long + [50] * short), np.array([3000] * long + [40] * short),
                 np.array([3000] * (long + short)))
    engine = EngineSimConfig(max_num_seqs=32)
    report = run_plan(w, h200, engine, ClusterSimConfig(2))
    best = min(r.bct_s for r in report.results)
    for r in report.results:
        assert tail_need(w, h200, engine, 2, r.bct_s).feasible, r.policy
    bound = tail_bound(w, h200, engine, 2, 10 * best)
    assert report.ideal.bct_s < bound <= best
    need = tail_need(w, h200, engine, 2, 0.5 * bound)
    assert need.rows == long and need.length == 3000 and not need.feasible
    # more time never needs more device time; too little for even one row alone is infeasible
    assert tail_need(w, h200, engine, 2, 2 * best).gpu_seconds <= tail_need(w, h200, engine, 2, best).gpu_seconds
    alone = 3000 * float(h200.step_seconds(1, 1, 0.0, 0.0))
    assert tail_need(w, h200, engine, 8, 0.9 * alone).gpu_seconds == float("inf")

def test_cooldown_is_the_plugins() -> None:
    from batchgen.cluster.plugin import BalancePlugin

    assert inspect.signature(BalancePlugin.__init__).parameters["cooldown"].default == PLUGIN_COOLDOWN_S


def test_batchgen_beats_static_on_a_skewed_job(h200) -> None:
    w = synthetic("reasoning", 600, 0, order="sorted")
    report = run_plan(w, h200, EngineSimConfig(), ClusterSimConfig(8))
    assert report.by_name("static").bct_s > 1.5 * report.by_name("batchgen").bct_s


def test_mixed_workload_orders() -> None:
    """mixed: one file of several sources. grouped keeps each source together in the mixture's
    order (reasoning first), random shuffles them; the rows are the same either way, and every
    row asks the same max_tokens, so the policies cannot tell the sources apart."""
    grouped, shuffled = synthetic("mixed", 1000, 0, order="grouped"), synthetic("mixed", 1000, 0)
    assert sorted(grouped.output_len) == sorted(shuffled.output_len)
    assert set(grouped.max_tokens) == {32768}
    assert grouped.output_len[:300].mean() > 4 * grouped.output_len[300:].mean()  # reasoning rows first
    third = len(shuffled.output_len) // 3
    assert 0.5 < shuffled.output_len[:third].mean() / shuffled.output_len[-third:].mean() < 2
    assert (synthetic("reasoning", 50, 1, order="grouped").output_len == synthetic("reasoning", 50, 1).output_len).all()
    with pytest.raises(PlanError, match="--order"):
        synthetic("mixed", 10, 0, order="backwards")  # type: ignore[arg-type]


def test_batchgen_evens_out_a_grouped_mixture(h200) -> None:
    w = synthetic("mixed", 800, 0, order="grouped")  # the first 2.4 of 8 partitions hold the reasoning rows
    report = run_plan(w, h200, EngineSimConfig(), ClusterSimConfig(8))
    assert report.by_name("static").bct_s > 1.3 * report.by_name("batchgen").bct_s  # 1.47 when written


# -- profiles, shapes, cost -----------------------------------------------------------------------
def test_every_shipped_profile_loads_and_names_its_sources() -> None:
    for name in BUILTIN_PROFILES:
        p = load_profile(name)
        assert isinstance(p, GpuProfile) and p.name == name
        assert any("datasheet" in text for text in p.sources.values())
        assert any("assumed" in text for text in p.sources.values())
    assert load_profile("h200") == load_profile("H200")


def test_shipped_model_shapes_match_published_parameter_counts() -> None:
    sizes = {m: load_shape(m) for m in BUILTIN_MODELS}
    assert sizes["qwen3-30b-a3b"].weight_bytes / 2 == pytest.approx(30.5e9, rel=0.01)
    assert sizes["qwen3-30b-a3b"].active_params_per_token == pytest.approx(3.3e9, rel=0.02)
    assert sizes["deepseek-v3"].weight_bytes / 2 == pytest.approx(671e9, rel=0.01)
    assert sizes["deepseek-v3"].active_params_per_token == pytest.approx(37e9, rel=0.02)
    assert sizes["mixtral-8x7b"].weight_bytes / 2 == pytest.approx(46.7e9, rel=0.01)


def test_experts_touched() -> None:
    np.testing.assert_allclose(experts_touched([0, 1, 10_000], 128, 8), [0, 8, 128])


def test_cost_orders_devices_and_offload_costs_time() -> None:
    shape = load_shape("qwen3-30b-a3b")
    h200, a100 = (build_cost(load_profile(n), shape) for n in ("H200", "A100-80G"))
    assert float(h200.step_seconds(64, 64, 64_000, 64_000)) < float(a100.step_seconds(64, 64, 64_000, 64_000))
    with pytest.raises(PlanError, match="--expert-memory"):
        build_cost(load_profile("A5000"), shape)
    small, big = (build_cost(load_profile("A5000"), shape, ExpertTiers(gib * 2**30)) for gib in (4, 12))
    assert float(small.step_seconds(8, 8, 8000, 8000)) > float(big.step_seconds(8, 8, 8000, 8000))
    assert small.kv_capacity_tokens > big.kv_capacity_tokens  # the memory not spent on experts holds KV


def test_one_a5000_with_offloaded_experts_plans(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan_json(capsys, "--rows", "64", "--workers", "1", "--profile", "A5000", "--expert-memory", "8GiB",
                     "--workload", "classification")
    fast = _plan_json(capsys, "--rows", "64", "--workers", "1", "--profile", "H200", "--workload", "classification")
    assert out["policies"]["static"]["bct_s"] > fast["policies"]["static"]["bct_s"]


# -- bad input: exit 2, a message naming what is wrong ---------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--rows", "10", "--workers", "2", "--profile", "B300"], "not a shipped profile"),
    (["--rows", "10", "--workers", "2", "--profile", "H200", "--lengths", "/nonexistent.csv"], "no such file"),
    (["--rows", "10", "--workers", "2", "--profile", "H200", "--model", "/nonexistent"], "no config.json"),
    (["--rows", "10", "--workers", "2", "--profile", "A5000"], "--expert-memory"),
    (["--workers", "2", "--profile", "H200"], "--rows"),
    (["--rows", "10", "--profile", "H200"], "--workers"),
    (["--rows", "0", "--workers", "2", "--profile", "H200"], "--rows must be >= 1"),
])
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_lengths_files_in_every_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    df = pd.DataFrame({"prompt_tokens": [100, 2000, 30], "output_tokens": [50, 10, 900], "other": ["a", "b", "c"]})
    paths = [tmp_path / "l.csv", tmp_path / "l.jsonl", tmp_path / "l.parquet"]
    df.to_csv(paths[0], index=False)
    df.to_json(paths[1], orient="records", lines=True)
    df.to_parquet(paths[2])
    for path in paths:
        w = load_lengths(path)
        assert w.prompt_len.tolist() == [100, 2000, 30] and w.output_len.tolist() == [50, 10, 900]
        assert w.max_tokens.tolist() == [50, 10, 900]
    out = _plan_json(capsys, "--workers", "2", "--profile", "H200", "--lengths", str(paths[0]))
    assert out["policies"]["batchgen"]["bct_s"] > 0


def test_bad_lengths_columns_and_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"prompt": [1], "out": [2]}).to_csv(bad, index=False)
    assert main(["plan", "--workers", "2", "--profile", "H200", "--lengths", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "prompt_tokens" in err and "it has prompt, out" in err
    neg = tmp_path / "neg.csv"
    pd.DataFrame({"prompt_tokens": [5, 7], "output_tokens": [3, -1]}).to_csv(neg, index=False)
    with pytest.raises(PlanError, match="row 1, column output_tokens"):
        load_lengths(neg)


def test_openai_batch_file_needs_a_model_dir(tmp_path: Path) -> None:
    f = tmp_path / "batch.jsonl"
    f.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                             "body": {"prompt": "hi", "max_tokens": 8}}) + "\n")
    with pytest.raises(PlanError, match="--model must be a model directory"):
        load_lengths(f)


def test_openai_batch_file_is_tokenized(tmp_path: Path, checkpoint_factory) -> None:  # type: ignore[no-untyped-def]
    model = checkpoint_factory("mixtral")
    f = tmp_path / "batch.jsonl"
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hello world " * (i + 1), "max_tokens": 4 + i}} for i in range(5)]
    f.write_text("\n".join(map(json.dumps, lines)) + "\n")
    w = load_lengths(f, model, "reasoning")
    assert w.rows == 5 and (np.diff(w.prompt_len) > 0).all()
    assert w.max_tokens.tolist() == [4, 5, 6, 7, 8] and (w.output_len <= w.max_tokens).all()


def test_package_lists_the_simulator_and_its_data() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "batchgen.sim" in project["tool"]["setuptools"]["packages"]
    globs = project["tool"]["setuptools"]["package-data"]["batchgen.sim"]
    for pattern in globs:
        assert list((ROOT / "batchgen" / "sim").glob(pattern)), pattern


def test_ideal_bound_terms(h200) -> None:
    w = synthetic("reasoning", 1000, 0)
    one, many = (ideal_bound(w, h200, EngineSimConfig(), n) for n in (1, 1000))
    assert one.work_s == pytest.approx(1000 * many.work_s)
    assert many.bct_s == many.longest_row_s  # a thousand workers wait for the longest row


def test_a_tick_given_to_run_plan_is_the_tick_simulated(h200) -> None:
    w = synthetic("reasoning", 400, 0)
    engine = EngineSimConfig()
    given = [r.bct_s for r in run_plan(w, h200, engine, ClusterSimConfig(4), tick_s=7.0).results]
    default = [r.bct_s for r in run_plan(w, h200, engine, ClusterSimConfig(4)).results]
    direct = [r.bct_s for r in sim_cluster.simulate_all(w, h200, engine, DEFAULT_POLICIES, ClusterSimConfig(4, tick_s=7.0))]
    assert given == direct
    assert given != default  # the tick matters on this job (dynamic deals once a tick)
