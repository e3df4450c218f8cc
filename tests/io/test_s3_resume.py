"""A file job on a real S3 API (moto's server mode, s3fs as the client): a gzipped JSONL input on
S3, a Parquet dataset output on S3, the driver SIGKILLed mid-job (a real ``batchgen run``
subprocess, a real signal), and ``--resume`` finishing it: every custom_id exactly once, tokens
equal to an uninterrupted run. Also the bad-input cases that must exit 2 in seconds, writing
nothing: a missing bucket, missing credentials, an unreadable object."""
from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from demo_builder import build_demo_model

from batchgen.cli import main

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

REPO = Path(__file__).resolve().parents[2]
TINY: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                            intermediate_size=64, vocab_size=320, max_position_embeddings=128, dtype="float32")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
# the tiny CPU model runs 100 to 2000 rows/s here (2 shared cores): small enough to stay near a
# minute, with parts of FLUSH_ROWS rows so that the kill lands mid-job however fast it runs
ROWS = 1000
FLUSH_ROWS = 40
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3(endpoint: str) -> Any:
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint},
                           use_listings_cache=False)
    fs.mkdir("jobs")
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": " ".join(WORDS[(i * 3 + k) % 10] for k in range(1 + i % 4))}})
             for i in range(ROWS)]
    fs.pipe("jobs/in.jsonl.gz", gzip.compress(("\n".join(lines) + "\n").encode()))
    fs.pipe("jobs/broken.jsonl.gz", b"this is not gzip at all")
    return fs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.getbasetemp() / "s3-model", **TINY)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_CONFIG_FILE="/nonexistent", **extra)
    return env


def _args(model: Path, endpoint: str, src: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "batchgen", *_cli(model, endpoint, src, out, *extra)]


def _cli(model: Path, endpoint: str, src: str, out: str, *extra: str) -> list[str]:
    return ["run", "--model", str(model), "--input", src, "--output", out,
            "--storage-option", f"client_kwargs.endpoint_url={endpoint}", "--temperature", "0",
            "--max-tokens", "4", "--chunk-size", "64", "--progress", "off", *extra]


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """``batchgen`` in this process, with the subprocesses' AWS environment: (exit code, stderr)."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in _env(**CREDENTIALS).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)

    def run(argv: list[str]) -> tuple[int, str]:
        capsys.readouterr()
        code = main(argv)
        return code, capsys.readouterr().err
    return run


def _rows(s3: Any, prefix: str) -> dict[str, tuple[str, int, int]]:
    table = ds.dataset(f"jobs/{prefix}", format="parquet", filesystem=s3).to_table()
    out: dict[str, tuple[str, int, int]] = {}
    for r in table.to_pylist():
        assert r["custom_id"] not in out, f"{r['custom_id']} written twice"
        out[r["custom_id"]] = (r["generated_text"], r["num_input_tokens"], r["num_generated_tokens"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_then_resume_on_s3_is_exactly_once(model: Path, endpoint: str, s3: Any, here) -> None:
    env = _env(**CREDENTIALS)
    code, err = here(_cli(model, endpoint, "s3://jobs/in.jsonl.gz", "s3://jobs/ref/"))
    assert code == 0, err
    assert s3.exists("jobs/ref/_SUCCESS")
    want = _rows(s3, "ref")
    assert len(want) == ROWS

    job = subprocess.Popen(_args(model, endpoint, "s3://jobs/in.jsonl.gz", "s3://jobs/out/"),
                           env={**env, "DASK_BATCHGEN__FILE_JOB_FLUSH_ROWS": str(FLUSH_ROWS)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not s3.glob("jobs/out/part-*.parquet", refresh=True):
        assert job.poll() is None, job.stderr.read() if job.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert not s3.exists("jobs/out/_SUCCESS")
    written = sum(ds.dataset(p, format="parquet", filesystem=s3).count_rows()
                  for p in s3.glob("jobs/out/part-*.parquet"))
    assert 0 < written < ROWS, written  # killed mid-job

    code, err = here(_cli(model, endpoint, "s3://jobs/in.jsonl.gz", "s3://jobs/out/", "--resume",
                          "--summary-json", "s3://jobs/summary.json"))
    assert code == 0, err
    assert s3.exists("jobs/out/_SUCCESS")
    assert _rows(s3, "out") == want  # every custom_id once, tokens equal to the uninterrupted run
    summary = json.loads(s3.cat("jobs/summary.json"))
    assert summary["request_counts"] == {"total": ROWS, "completed": ROWS, "failed": 0}
    assert summary["this_run"]["resumed"] == written
    assert json.loads(err.strip().splitlines()[-1]) == summary


def _refused(cmd: list[str], env: dict[str, str], named: str) -> None:
    start = time.monotonic()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert named in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert time.monotonic() - start < 30  # seconds, not retries for minutes


def _refused_here(here, argv: list[str], named: str) -> None:
    start = time.monotonic()
    code, err = here(argv)
    assert code == 2 and named in err, err  # a message, not a raise
    assert time.monotonic() - start < 30  # seconds, not retries for minutes


def test_bad_s3_inputs_exit_2_and_write_nothing(model: Path, endpoint: str, s3: Any, here) -> None:
    _refused_here(here, _cli(model, endpoint, "s3://no-such-bucket/in.jsonl", "s3://jobs/bad1/"),
                  "no such file or bucket")
    _refused_here(here, _cli(model, endpoint, "s3://jobs/in.jsonl.gz", "s3://no-such-bucket/out/"), "no such bucket")
    _refused_here(here, _cli(model, endpoint, "s3://jobs/broken.jsonl.gz", "s3://jobs/bad2/"), "cannot read")
    # its own process: s3fs caches filesystems, and this one must find no credentials anywhere
    _refused(_args(model, endpoint, "s3://jobs/in.jsonl.gz", "s3://jobs/bad3/"), _env(), "credentials")
    assert not s3.glob("jobs/bad*", refresh=True)
