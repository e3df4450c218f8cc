"""Regression tests from an adversarial review of `batchgen plan` (issue 10): inputs and models the
first tests did not try."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchgen.cli import main
from batchgen.sim.cluster import ClusterSimConfig
from batchgen.sim.cost import build_cost
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.planner import ideal_bound, run_plan
from batchgen.sim.profiles import FittedProfile, load_profile
from batchgen.sim.shapes import load_shape
from batchgen.sim.workload import Workload, synthetic

# OLMoE-1B-7B's published shapes: 64 experts, top 8, no GQA (a large KV per token)
OLMOE = {"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
         "vocab_size": 50304, "max_position_embeddings": 4096, "rope_theta": 10000.0, "hidden_act": "silu"}
FITTED = dict(kind="fitted", name="f", model="m", coefficients={"overhead_s": 0.003, "per_token_s": 3e-5,
              "per_kv_token_s": 5e-7}, kv_capacity_tokens=8192, kv_bytes_per_token=1024, num_experts=0, top_k=0,
              num_moe_layers=0, network_bytes_per_s=1e9, host_bytes_per_s=1e9, source="by hand")


def _err(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_zero_workers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--workers must be >= 1, got 0" in _err(capsys, "--rows", "10", "--workers", "0", "--profile", "H200")


@pytest.mark.parametrize("change, message", [
    ({"memory_bytes": "80GB"}, "memory_bytes must be a number > 0, got '80GB'"),
    ({"step_overhead_s": -1}, "step_overhead_s must be a number >= 0"),
    ({"compute_efficiency": True}, "compute_efficiency must be a number > 0"),
])
def test_gpu_profile_fields_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict,
                                        message: str) -> None:
    data = {"name": "x", "memory_bytes": 8e10, "peak_flops": 1e15, "hbm_bytes_per_s": 3e12,
            "pcie_bytes_per_s": 6e10, "network_bytes_per_s": 5e10, **change}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert message in _err(capsys, "--rows", "10", "--workers", "2", "--profile", str(path))


@pytest.mark.parametrize("change, message", [
    ({"coefficients": {}}, "coefficients give a forward no time"),
    ({"coefficients": {"per_tok_s": 1.0}}, "unknown coefficients ['per_tok_s']"),
    ({"coefficients": {"overhead_s": "a"}}, "coefficients.overhead_s must be a number >= 0"),
    ({"kv_capacity_tokens": "100"}, "kv_capacity_tokens must be an integer >= 1"),
    ({"fit": []}, "fit must be an object"),
])
def test_fitted_profile_fields_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict,
                                           message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**FITTED, **change}))
    assert message in _err(capsys, "--rows", "10", "--workers", "2", "--profile", str(path))


def test_no_policy_beats_the_ideal_bound_where_the_kv_pool_binds(tmp_path: Path) -> None:
    """A KV-bound MoE: real steps mix short and long rows in batches larger than pool / mean
    context, amortizing the experts; the bound must still hold (it did not: batchgen 0.97x it)."""
    (tmp_path / "config.json").write_text(json.dumps(OLMOE))
    cost = build_cost(load_profile("A5000"), load_shape(tmp_path))
    w = synthetic("reasoning", 160, 0)
    report = run_plan(w, cost, EngineSimConfig(), ClusterSimConfig(2))
    for r in report.results:
        assert r.rows_done == 160 and r.bct_s >= report.ideal.bct_s, (r.policy, r.bct_s, report.ideal)


def test_rows_past_the_pool_are_left_out_of_the_ideal_bound() -> None:
    cost = build_cost(FittedProfile(**{k: v for k, v in FITTED.items() if k != "kind"}), None)
    fits = Workload("w", np.array([100, 200]), np.array([50, 60]), np.array([50, 60]))
    both = Workload("w", np.array([100, 200, 9000]), np.array([50, 60, 30000]), np.array([50, 60, 30000]))
    assert ideal_bound(both, cost, EngineSimConfig(), 1) == ideal_bound(fits, cost, EngineSimConfig(), 1)


def test_failed_rows_are_counted_per_policy_and_warned_in_json(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    lengths = tmp_path / "l.csv"
    lengths.write_text("prompt_tokens,output_tokens\n100000,3\n2,4\n")
    assert main(["plan", "--lengths", str(lengths), "--workers", "2", "--profile", "H100"]) == 0
    assert "(static 1, dynamic 1, batchgen 1)" in capsys.readouterr().out  # not 3 rows of 2
    assert main(["plan", "--lengths", str(lengths), "--workers", "2", "--profile", "H100", "--json"]) == 0
    cap = capsys.readouterr()
    assert "count as failed" in cap.err and json.loads(cap.out)["ideal_bct_s"] > 0


def test_a_dense_model_that_does_not_fit_is_not_told_to_offload_experts(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    llama70b = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(llama70b))
    err = _err(capsys, "--rows", "10", "--workers", "1", "--profile", "A5000", "--model", str(tmp_path))
    assert "does not fit one A5000" in err and "no experts to offload" in err and "--expert-memory" not in err
    llama8b = {**llama70b, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32}
    (tmp_path / "config.json").write_text(json.dumps(llama8b))
    assert main(["plan", "--rows", "10", "--workers", "1", "--profile", "A5000", "--model", str(tmp_path),
                 "--expert-memory", "1GiB", "--workload", "classification", "--json"]) == 0
    assert "is dense: --expert-memory has no routed experts" in capsys.readouterr().err
    err = _err(capsys, "--rows", "10", "--workers", "1", "--profile", "A5000", "--model", "deepseek-v3",
               "--expert-memory", "4GiB")
    assert "non-expert weights" in err and "cannot help" in err


def test_png_without_matplotlib_fails_before_simulating(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import batchgen.sim.cluster as sim_cluster

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    monkeypatch.setattr(sim_cluster, "simulate", lambda *a, **k: pytest.fail("simulated before the check"))
    err = _err(capsys, "--rows", "10", "--workers", "2", "--profile", "H100", "--png", str(tmp_path / "u.png"))
    assert "pip install 'batchgen[plot]'" in err
    monkeypatch.undo()
    assert "no such directory" in _err(capsys, "--rows", "10", "--workers", "2", "--profile", "H100", "--png",
                                       str(tmp_path / "missing" / "u.png"))


def test_bench_sim_million_honours_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """--rows 100000 with --million meant 1M rows (100,000 was the default's sentinel)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_sim.py"
    spec = importlib.util.spec_from_file_location("bench_sim", path)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    calls: list[tuple] = []
    monkeypatch.setattr(bench, "million", lambda *a: calls.append(a))
    for argv, rows in ((["--rows", "100000"], 100_000), (["--rows", "300"], 300), ([], 1_000_000)):
        monkeypatch.setattr("sys.argv", ["bench_sim.py", "--million", *argv])
        bench.main()
        assert calls.pop()[0] == rows


def test_lengths_files_odd_but_readable_or_clearly_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.errors import PlanError
    from batchgen.sim.workload import load_lengths

    frac = tmp_path / "frac.csv"
    frac.write_text("prompt_tokens,output_tokens\n5,3.5\n")
    with pytest.raises(PlanError, match=r"got 3\.5$"):
        load_lengths(frac)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(PlanError, match="no rows in it"):
        load_lengths(empty)
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"prompt_tokens": 5, "output_tokens": 6}, {"prompt_tokens": 7, "output_tokens": 8}]))
    assert load_lengths(array).output_len.tolist() == [6, 8]


def test_openai_batch_with_a_mixture_and_an_invalid_line(tmp_path: Path, checkpoint_factory,  # type: ignore[no-untyped-def]
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.sim.workload import load_lengths

    model = checkpoint_factory("mixtral")
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hello world " * (i + 1), "max_tokens": 40}} for i in range(6)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "x", "max_tokens": -3}})
    f = tmp_path / "batch.jsonl"
    f.write_text("\n".join(map(json.dumps, lines)) + "\n")
    w = load_lengths(f, model, "mixed")
    assert w.rows == 6 and (w.output_len <= 40).all()
    assert "1 invalid request(s)" in capsys.readouterr().err


def test_a_calibrated_profile_says_it_ignores_another_models_shapes(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(FITTED))
    (tmp_path / "other").mkdir()
    assert main(["plan", "--rows", "20", "--workers", "2", "--profile", str(path), "--model", str(tmp_path / "other"),
                 "--workload", "classification", "--json"]) == 0
    assert "was measured with m" in capsys.readouterr().err


def test_same_seed_same_plan_other_seed_other_rows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--rows", "60", "--workers", "3", "--profile", "L4", "--model", "mixtral-8x7b", "--expert-memory", "8GiB",
            "--workload", "chat"]
    runs = [main(["plan", *argv, "--seed", s, "--json"]) or capsys.readouterr().out for s in ("3", "3", "4")]
    assert runs[0] == runs[1] != runs[2]


def test_more_bad_inputs_fail_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--seed must be >= 0" in _err(capsys, "--rows", "10", "--workers", "2", "--profile", "H100", "--seed", "-1")
    too_long = tmp_path / "l.csv"
    too_long.write_text("prompt_tokens,output_tokens\n100000,3\n")
    assert "no row fits one worker's KV pool" in _err(capsys, "--lengths", str(too_long), "--workers", "2",
                                                      "--profile", "H100")
    bad_k = {**OLMOE, "num_experts_per_tok": 80}
    (tmp_path / "config.json").write_text(json.dumps(bad_k))
    assert "experts per token 80" in _err(capsys, "--rows", "10", "--workers", "2", "--profile", "H100",
                                          "--model", str(tmp_path))
    for change, message in (({"top_k": 8, "num_experts": 4}, "top_k must be in [1, num_experts=4]"),
                            ({"expert_traffic": {"per_forward": [[1, 2]]}}, "per_forward: [[tokens"),
                            ({"expert_traffic": {"per_forward": [["a", 1, 2]]}}, "per_forward: numbers expected")):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({**FITTED, **change}))
        assert message in _err(capsys, "--rows", "10", "--workers", "2", "--profile", str(path))
    assert main(["bench", "--calibrate", str(tmp_path), "-o", str(tmp_path / "no" / "p.json")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_a_calibrated_profile_plans_the_engine_it_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    sim_plan = importlib.import_module("batchgen.sim.planner")
    seen: list[EngineSimConfig] = []
    real = sim_plan.run_plan
    monkeypatch.setattr(sim_plan, "run_plan", lambda w, c, engine, *a, **k: seen.append(engine) or real(w, c, engine, *a, **k))
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**FITTED, "fit": {"engine": {"max_num_seqs": 8, "max_num_batched_tokens": 2048}}}))
    argv = ["plan", "--rows", "20", "--workers", "2", "--profile", str(path), "--workload", "classification", "--json"]
    assert main(argv) == 0 and main([*argv, "--max-num-seqs", "4"]) == 0 and main([*argv[:6], "H100", *argv[7:]]) == 0
    capsys.readouterr()
    assert [(e.max_num_seqs, e.max_num_batched_tokens) for e in seen] == [(8, 2048), (4, 2048), (256, 8192)]


def test_calibrate_bad_settings_fail_with_one_message(tmp_path: Path, checkpoint_factory,  # type: ignore[no-untyped-def]
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = checkpoint_factory("mixtral")
    out = str(tmp_path / "p.json")
    for flags, message in ((["--threads", "0"], "--threads must be >= 1"),
                           (["--kv-cache-bytes", "0"], "must be a positive size"),  # the one size parser
                           (["--kv-cache-bytes", "10KiB"], "the calibration grid needs")):
        try:
            code = main(["bench", "--calibrate", str(model), "-o", out, "--quick", *flags])
        except SystemExit as exc:  # a flag argparse refuses exits from the parser, with the same code
            code = exc.code
        assert code == 2
        assert message in capsys.readouterr().err


def test_a_local_directory_named_like_a_shipped_model_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mixtral-8x7b").mkdir()
    (tmp_path / "mixtral-8x7b" / "config.json").write_text(json.dumps(OLMOE))
    monkeypatch.chdir(tmp_path)
    assert load_shape("mixtral-8x7b").num_experts == 64  # the directory's, not Mixtral's 8


def test_a_repeated_sweep_count_is_simulated_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--rows", "40", "--profile", "H100", "--sweep-workers", "2,2,4", "--workload", "chat"]) == 0
    sweep = capsys.readouterr().out.split("sweep (simulated)")[1].splitlines()
    assert [line.split()[0] for line in sweep[2:]] == ["2", "4"]


def test_order_with_a_lengths_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = tmp_path / "l.csv"
    lengths.write_text("prompt_tokens,output_tokens\n10,3\n2,4\n")
    err = _err(capsys, "--lengths", str(lengths), "--workers", "2", "--profile", "H100", "--order", "sorted")
    assert "--order sorted" in err and "its own order" in err
    assert main(["plan", "--lengths", str(lengths), "--workers", "2", "--profile", "H100", "--json"]) == 0


def test_boolean_lengths_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pandas as pd

    lengths = tmp_path / "l.parquet"
    pd.DataFrame({"prompt_tokens": [10, 20], "output_tokens": [True, False]}).to_parquet(lengths)
    err = _err(capsys, "--lengths", str(lengths), "--workers", "2", "--profile", "H100")
    assert "row 0, column output_tokens" in err and "True" in err
