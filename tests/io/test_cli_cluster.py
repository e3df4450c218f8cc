"""`batchgen run --workers N`: the same job on a real local Dask cluster (processes)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchgen.cli import main
from batchgen.io.openai_batch import record_error

LINES = [
    {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": text, "max_tokens": n, "temperature": 0.0}}
    for i, (text, n) in enumerate([("The quick brown fox", 6), ("def f(x):", 9), ("Lists in Python", 3),
                                   ("", 4), ("A dictionary maps", 12), ("Exceptions", 5)])
]


def _run(model: Path, src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen.cli", "run", "--model", str(model), "--input", str(src),
                           "--output", str(out), "--progress", "off", "--max-error-rate", "0.5", *extra],
                          capture_output=True, text=True, timeout=300)


def _run_here(capsys: pytest.CaptureFixture[str], model: Path, src: Path, out: Path, *extra: str
              ) -> tuple[int, str]:
    """The same command in this process (no interpreter start-up): its code and its stderr."""
    capsys.readouterr()
    code = main(["run", "--model", str(model), "--input", str(src), "--output", str(out), "--progress", "off",
                 "--max-error-rate", "0.5", *extra])
    return code, capsys.readouterr().err


def _by_id(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["custom_id"]: r for r in rows}


@pytest.mark.slow
def test_run_on_local_dask_cluster_matches_local_engine(checkpoint_factory, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    model = checkpoint_factory("mixtral")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    local, clustered = tmp_path / "local.jsonl", tmp_path / "cluster.jsonl"
    code, err = _run_here(capsys, model, src, local)
    assert code == 0, err
    report = tmp_path / "report.html"
    code, err = _run_here(capsys, model, src, clustered, "--workers", "2", "--chunk-size", "4", "--report",
                          str(report))
    assert code == 0, err
    # --report: the job's charts in one HTML file with its resources inlined (opens offline)
    html = report.read_text()
    assert "<script src=" not in html and "Bokeh" in html and "batchgen" in html
    a, b = _by_id(local), _by_id(clustered)
    assert sorted(a) == sorted(b) == sorted(line["custom_id"] for line in LINES)
    for key in a:
        if record_error(a[key]) is None:
            assert a[key]["response"]["body"]["choices"] == b[key]["response"]["body"]["choices"]
            assert a[key]["response"]["body"]["usage"] == b[key]["response"]["body"]["usage"]
        else:
            assert record_error(b[key]) is not None and b[key]["response"]["status_code"] == 400
    assert "1 errors" in err or "1 error" in err


def test_report_without_a_cluster_is_refused_before_any_work(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(LINES[0]) + "\n")
    result = _run(tmp_path / "no-model", src, tmp_path / "out.jsonl", "--report", str(tmp_path / "r.html"))
    assert result.returncode == 2 and "--report needs --workers or --scheduler" in result.stderr
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "r.html").exists()


def test_cluster_run_with_missing_model_fails_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(LINES[0]) + "\n")
    code, err = _run_here(capsys, tmp_path / "no-model", src, tmp_path / "out.jsonl", "--workers", "2")
    assert code == 2 and "does not exist" in err  # a message, not a raise


def _cluster_state(client: Any) -> tuple[bool, list[int]]:
    """(plugin registered?, engines each worker holds)."""
    plugin = client.run_on_scheduler(lambda dask_scheduler: "batchgen-balance" in dask_scheduler.plugins)
    engines = client.run(lambda dask_worker: len(dask_worker.extensions["batchgen"].host.loads())
                         if "batchgen" in dask_worker.extensions else 0)
    return plugin, sorted(engines.values())


@pytest.mark.slow
def test_run_on_a_users_cluster_leaves_it_as_found(checkpoint_factory, tmp_path: Path) -> None:
    from distributed import Client, LocalCluster

    import batchgen.cluster as bc

    model = checkpoint_factory("mixtral")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in LINES[:3]))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        address = cluster.scheduler_address
        first = _run(model, src, tmp_path / "a.jsonl", "--scheduler", address)
        assert first.returncode == 0, first.stderr
        assert _cluster_state(client) == (False, [0, 0])  # we installed it: plugin and engines gone
        bc.connect(client=client)  # someone else runs batchgen on this cluster
        second = _run(model, src, tmp_path / "b.jsonl", "--scheduler", address)
        assert second.returncode == 0, second.stderr
        assert _cluster_state(client) == (True, [0, 0])  # their plugin stays; our idle engines go
        assert _by_id(tmp_path / "a.jsonl").keys() == _by_id(tmp_path / "b.jsonl").keys() == {"r0", "r1", "r2"}
