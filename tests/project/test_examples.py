"""The examples run as a user runs them, on small inputs: the ETL script in a subprocess and the
notebook executed headless (nbclient + ipykernel) on a real LocalCluster."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT), **extra}


def test_etl_cleaning(tmp_path: Path) -> None:
    out = tmp_path / "etl"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "etl_cleaning.py"), "--out-dir", str(out),
                           "--rows", "24", "--partitions", "2", "--workers", "1"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    clean = pd.read_parquet(out / "clean.parquet")
    failed = pd.read_parquet(out / "failed.parquet")
    assert len(clean) + len(failed) == 24
    assert {"customer_id", "name", "country", "signup", "signup_date"} <= set(clean.columns)
    assert "prompt" not in clean.columns and pd.api.types.is_datetime64_any_dtype(clean["signup_date"])
    # the sample's row with no date fails with the engine's message; it is listed
    missing = failed[failed["signup"].isna()]
    assert len(missing) == 1 and "prompt" in missing["error"].iloc[0]
    assert f"customer {missing['customer_id'].iloc[0]}: signup <NA>" in proc.stdout
    right = (clean["signup_date"].dt.strftime("%Y-%m-%d") == clean["true_signup"]).sum()
    assert right >= 20, proc.stdout  # 23 dates, >97% expected
    assert re.search(r"(\d+) of 24 rows cleaned", proc.stdout)[1] == str(len(clean))


def test_notebook_runs_headless(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    # the kernel inherits this process's environment
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    monkeypatch.setenv("BATCHGEN_NOTEBOOK_ROWS", "24")
    monkeypatch.setenv("BATCHGEN_NOTEBOOK_WORKERS", "1")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    cells = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors

    def outputs(marker: str) -> list[dict]:
        cell = next(c for c in cells if marker in c.source)
        return cell.outputs

    # the progress display is tqdm's notebook widget
    progress = outputs("batchgen.cluster.progress")
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in progress), progress
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    bars = [m["state"] for m in state.values() if m["model_name"] in ("FloatProgressModel", "IntProgressModel")]
    assert any(b.get("max") == 24 and b.get("value") == 24 for b in bars), bars  # all rows, counted
    metrics = outputs("batchgen.cluster.metrics")
    html = next(o["data"]["text/html"] for o in metrics if "text/html" in o.get("data", {}))
    assert "rows_done" in html and "tokens_per_s" in html and "expert_hit_rate" in html
    assert re.search(r"<td>24(\.0)?</td>", html)  # the one worker did all 24 rows
    text = "".join(o.get("text", "") for o in outputs("exact match"))
    right = int(re.search(r"exact match: (\d+)/24", text)[1])
    assert right >= 21, text
    assert json.dumps(nb)  # executed notebook still valid JSON


def test_engine_basic() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "engine_basic.py")], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the trained model's greedy answers, the empty prompt failing alone, the migrated row exact
    assert "'Sunday, March 7, 2021'    -> stop   '2021-03-07'" in proc.stdout, proc.stdout
    assert "'12/25/1987'               -> stop   '1987-12-25'" in proc.stdout, proc.stdout
    assert re.search(r"'\(empty\)'\s+-> error\s+prompt must not be empty", proc.stdout), proc.stdout
    assert "suspend/resume exact: True" in proc.stdout and "'1961-08-03'" in proc.stdout, proc.stdout


def test_dask_dataframe_example() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "dask_dataframe.py"), "--rows", "16"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    right, total = map(int, re.search(r"exact match: (\d+)/(\d+)", proc.stdout).groups())
    assert total == 16 and right >= 14, proc.stdout
    assert "cluster: {'rows_done': " in proc.stdout, proc.stdout  # as the workers last pushed it
