"""``batchgen run`` / ``batchgen demo`` as a user runs them: real files, real subprocesses,
SIGKILL in the middle of a job and --resume after it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from demo_builder import build_demo_model

from batchgen.cli import main
from batchgen.io.openai_batch import record_error, record_key

REPO = Path(__file__).resolve().parents[2]
TINY: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            num_experts=4, top_k=2, intermediate_size=64, vocab_size=320,
                            max_position_embeddings=128, dtype="float32")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.getbasetemp() / "io-tiny-model", **TINY)


def _cli(*args: str | Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "batchgen.cli", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _requests(n: int) -> list[str]:
    lines = []
    for i in range(n):
        prompt = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 5))
        if i % 4 == 1:
            body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
            url = "/v1/chat/completions"
        else:
            body, url = {"prompt": prompt}, "/v1/completions"
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                                 "body": body}))
    lines[5] = lines[5].replace('"POST"', '"GET"')  # bad method
    lines[9] = '{"custom_id": "req-9", "method": "POST", broken'
    lines[13] = lines[3]  # duplicate custom_id
    return lines


def _by_key(path: Path) -> dict[Any, dict[str, Any]]:
    out: dict[Any, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        key = record_key(r)
        assert key not in out, f"{key} written twice"
        out[key] = r
    return out


def _texts(records: dict[Any, dict[str, Any]]) -> dict[Any, Any]:
    def text(r: dict[str, Any]) -> Any:
        if record_error(r):
            return record_error(r)["message"]
        c = r["response"]["body"]["choices"][0]
        return c["text"] if "text" in c else c["message"]["content"]
    return {k: text(r) for k, r in records.items()}


def test_sigkill_then_resume_matches_clean_run(tmp_path: Path, model: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    src, out, clean = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "clean.jsonl"
    lines = _requests(96)
    src.write_text("\n".join(lines) + "\n")
    flags = ["--temperature", "0", "--max-tokens", "6", "--chunk-size", "8", "--progress", "lines"]
    proc = _cli("run", "--model", model, "--input", src, "--output", out, *flags)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = out.read_bytes().count(b"\n")
    assert 0 < killed_at < len(lines), "the job finished before it could be killed"

    assert main(["run", "--model", str(model), "--input", str(src), "--output", str(out)]) == 2
    assert "pass --resume" in capsys.readouterr().err
    again = _cli("run", "--model", model, "--input", src, "--output", out, "--resume", *flags)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert f"{len(lines) - killed_at} rows: " in err
    assert f"({killed_at} already done before this run)" in err

    assert main(["run", "--model", str(model), "--input", str(src), "--output", str(clean),
                 *flags[:-1], "off"]) == 0
    resumed, reference = _by_key(out), _by_key(clean)
    assert len(reference) == len(lines) and set(resumed) == set(reference)
    assert _texts(resumed) == _texts(reference)
    assert record_error(reference[("line", 10)])["code"] == "invalid_json"
    assert record_error(reference[("line", 14)])["code"] == "duplicate_custom_id"
    assert record_error(reference[("id", "req-5")])["code"] == "invalid_method"


def test_overwrite_and_parquet(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"prompt": ["alpha beta", "gamma", ""], "k": [1, 2, 3]}), src)
    args = ["run", "--model", str(model), "--input", str(src), "--output", str(out),
            "--max-tokens", "3", "--temperature", "0", "--progress", "off", "--max-error-rate", "0.5"]
    assert main(args) == 0
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert "3 rows: 2 succeeded, 1 errors" in err and "some rows failed" in err
    table = pq.read_table(out)
    assert table.column("k").to_pylist() == [1, 2, 3]
    assert table.column("num_generated_tokens").to_pylist()[:2] == [3, 3]


def _fail_fast_cases(tmp_path: Path, model: Path) -> list[tuple[list[str], str]]:
    good = tmp_path / "in.jsonl"
    good.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                    '"body": {"prompt": "x"}}\n')
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "t.parquet")
    (tmp_path / "done.jsonl").write_text("")
    m, o = str(model), str(tmp_path / "o.jsonl")
    return [
        (["--model", str(tmp_path / "no-model"), "--input", str(good), "--output", o], "no-model"),
        (["--model", str(tmp_path), "--input", str(good), "--output", o], "config.json"),
        (["--model", m, "--input", str(tmp_path / "in.csv"), "--output", o], "extension"),
        (["--model", m, "--input", str(tmp_path / "missing.jsonl"), "--output", o], "no such file"),
        (["--model", m, "--input", str(tmp_path / "t.parquet"), "--output", o], "written as Parquet"),
        (["--model", m, "--input", str(tmp_path / "bad.parquet"), "--output",
          str(tmp_path / "o.parquet")], "cannot read"),
        (["--model", m, "--input", str(tmp_path / "t.parquet"), "--output",
          str(tmp_path / "o.parquet")], "no column 'prompt'"),
        (["--model", m, "--input", str(good), "--output", str(tmp_path / "done.jsonl")],
         "already exists"),
        (["--model", m, "--input", str(good), "--output", o, "--temperature", "-1"],
         "temperature"),
    ]


def test_fail_fast_exit_2(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, named in _fail_fast_cases(tmp_path, model):
        assert main(["run", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("batchgen: error: ") and named in err, (args, err)
        assert err.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / "o.jsonl").exists()  # nothing was started


def test_fail_fast_subprocess(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    proc = _cli("run", "--model", tmp_path / "nowhere", "--input", src, "--output",
                tmp_path / "out.jsonl")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "nowhere" in err and "Traceback" not in err


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ["--model", "--input", "--output", "--resume", "--overwrite", "--prompt-column",
                 "--id-column", "--param-column", "--per-row-params", "--max-tokens",
                 "--temperature", "--top-p", "--top-k", "--min-p", "--seed", "--stop",
                 "--ignore-eos", "--logprobs", "--chunk-size", "--progress", "--dtype"]:
        assert flag in text


def test_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # The shipped trained model on the bundled table's first 40 rows (all 300 take longer).
    import pandas as pd

    from batchgen.demo.table import table_rows

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--progress", "off", "--rows", "40"]) == 0
    result = pd.read_parquet(tmp_path / "demo_out" / "results.parquet")
    rows = table_rows()[:40]
    assert list(result["id"]) == [r["id"] for r in rows] and list(result["signup"]) == [r["signup"] for r in rows]
    assert result["error"].isna().all()
    out = capsys.readouterr().out
    assert out.count(" -> ") == 6 and "40 rows: 40 succeeded, 0 errors" in out and "tok/s" in out
    right = int(re.search(r"accuracy (\d+)/40", out)[1])
    assert right == sum(a.strip() == r["iso"] for a, r in zip(result["generated_text"], rows))
    assert right >= 36  # the model's measured exact match is >97% (tests/test_demo.py)
