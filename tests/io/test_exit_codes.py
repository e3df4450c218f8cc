"""Exit codes and the job summary: every row bad -> 3 whatever the budget; 1% bad under the
default budget (5%) -> 0; over it -> 3; the summary JSON's counts equal the output's;
``--error-file`` splits failed rows out; bad inputs (an http 404, a filesystem whose extra is
not installed) exit 2 writing nothing; one size parser; ``python -m batchgen``."""
from __future__ import annotations

import functools
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from demo_builder import build_demo_model

from batchgen.cli import main
from batchgen.io.openai_batch import record_error
from batchgen.io.report import DEFAULT_MAX_ERROR_RATE, EXIT_TOO_MANY_ERRORS

TINY: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                            intermediate_size=64, vocab_size=320, max_position_embeddings=128, dtype="float32")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.getbasetemp() / "exit-model", **TINY)


def _input(path: Path, n: int, bad: set[int]) -> Path:
    lines = []
    for i in range(n):
        body: dict[str, Any] = {"prompt": "alpha beta"} if i not in bad else {"prompt": "x", "top_p": 7}
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(model: Path, src: Path | str, out: Path | str, *extra: str) -> int:
    return main(["run", "--model", str(model), "--input", str(src), "--output", str(out), "--max-tokens", "1",
                 "--progress", "off", *extra])


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_every_row_bad_never_exits_0(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _input(tmp_path / "in.jsonl", 4, {0, 1, 2, 3})
    assert _run(model, src, tmp_path / "out.jsonl", "--max-error-rate", "1") == EXIT_TOO_MANY_ERRORS
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert summary["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    assert summary["status"] == "completed_with_too_many_errors"


def test_error_budget_and_summary_counts(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert DEFAULT_MAX_ERROR_RATE == 0.05
    src = _input(tmp_path / "in.jsonl", 100, {37})  # 1% bad: within the default budget
    out, summary_path = tmp_path / "out.jsonl", tmp_path / "summary.json"
    assert _run(model, src, out, "--summary-json", str(summary_path)) == 0
    summary = json.loads(summary_path.read_text())
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1]) == summary
    records = _records(out)
    failed = sum(1 for r in records if record_error(r))
    assert summary["request_counts"] == {"total": len(records), "completed": len(records) - failed, "failed": failed}
    assert summary["request_counts"] == {"total": 100, "completed": 99, "failed": 1}
    assert summary["usage"]["generated_tokens"] == 99 and summary["usage"]["prompt_tokens"] > 0
    assert summary["exit_code"] == 0 and summary["timing"]["wall_s"] > 0

    src = _input(tmp_path / "in10.jsonl", 20, {1, 5, 9})  # 15% bad
    assert _run(model, src, tmp_path / "out10.jsonl") == EXIT_TOO_MANY_ERRORS
    assert _run(model, src, tmp_path / "out10b.jsonl", "--max-error-rate", "0.2") == 0


def test_error_file_holds_the_failed_rows(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _input(tmp_path / "in.jsonl", 10, {2, 6})
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    assert _run(model, src, out, "--error-file", str(errors), "--max-error-rate", "0.5") == 0
    assert [r["custom_id"] for r in _records(errors)] == ["r2", "r6"]
    assert all(record_error(r)["type"] == "invalid_request_error" for r in _records(errors))
    assert len(_records(out)) == 8 and not any(record_error(r) for r in _records(out))
    capsys.readouterr()
    assert _run(model, src, out, "--error-file", str(errors), "--max-error-rate", "0.5", "--resume") == 0
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert summary["request_counts"] == {"total": 10, "completed": 8, "failed": 2}
    assert summary["this_run"]["resumed"] == 10


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture()
def http_root(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()


def test_http_input_and_bad_inputs_exit_2(model: Path, tmp_path: Path, http_root: tuple[str, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    url, root = http_root
    _input(root / "in.jsonl", 3, set())
    assert _run(model, f"{url}/in.jsonl", tmp_path / "out.jsonl") == 0
    assert len(_records(tmp_path / "out.jsonl")) == 3
    capsys.readouterr()
    cases = [(f"{url}/missing.jsonl", "no such file"), ("gs://bucket/in.jsonl", "batchgen[gcs]"),
             ("abfs://container/in.jsonl", "batchgen[azure]")]
    for src, named in cases:
        out = tmp_path / "never.jsonl"
        assert _run(model, src, out) == 2, src
        err = capsys.readouterr().err
        assert err.startswith("batchgen: error: ") and named in err and err.count("\n") == 1, err
        assert not out.exists() and not (tmp_path / "never.jsonl.input.json").exists()


def test_one_size_parser_for_every_command() -> None:
    from batchgen.config import parse_size
    from batchgen.sim.cli import parse_size as plan_size

    assert plan_size("8G") == parse_size("8G", "x") == 8 * 10**9
    assert plan_size("2GiB") == 2 * 2**30 and plan_size("512MB") == 512 * 10**6


def test_python_m_batchgen_and_version() -> None:
    from batchgen import __version__

    res = subprocess.run([sys.executable, "-m", "batchgen", "--version"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"batchgen {__version__}"
    res = subprocess.run([sys.executable, "-m", "batchgen", "run", "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert res.returncode == 0 and "--max-error-rate" in res.stdout and "--log-level" in res.stdout


def test_quiet_leaves_only_the_summary_line(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _input(tmp_path / "in.jsonl", 2, set())
    assert _run(model, src, tmp_path / "out.jsonl", "-q") == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["request_counts"]["completed"] == 2
    assert _run(model, src, tmp_path / "out2.jsonl", "--log-level", "info") == 0
    assert "batchgen: wrote" in capsys.readouterr().err


def test_plan_reads_lengths_from_a_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import fsspec

    with fsspec.open("memory://plans/lengths.csv", "w") as f:
        f.write("prompt_tokens,output_tokens\n" + "".join(f"{10 + i},{20 + i}\n" for i in range(8)))
    assert main(["plan", "--workers", "2", "--profile", "H200", "--lengths", "memory://plans/lengths.csv",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"]["batchgen"]["bct_s"] > 0
    assert main(["plan", "--workers", "2", "--profile", "H200", "--lengths", "memory://plans/none.csv"]) == 2
