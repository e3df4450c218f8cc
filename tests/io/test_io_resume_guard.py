"""--resume refuses outputs made from another input, and a failed adoption leaves no trace."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd


def _run(model: Path, src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen.cli", "run", "--model", str(model), "--input", str(src),
                           "--output", str(out), "--progress", "off", "--max-tokens", "2", *extra],
                          capture_output=True, text=True, timeout=120)


def _jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": p}}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_resume_with_another_input_is_refused(checkpoint_factory, tmp_path: Path) -> None:
    model = checkpoint_factory("llama")
    first, other, out = _jsonl(tmp_path / "a.jsonl", ["one", "two"]), _jsonl(tmp_path / "b.jsonl", ["x"]), \
        tmp_path / "out.jsonl"
    assert _run(model, first, out).returncode == 0
    before = out.read_text()
    refused = _run(model, other, out, "--resume")
    assert refused.returncode == 2 and "started from another input" in refused.stderr
    assert out.read_text() == before
    assert _run(model, first, out, "--resume").returncode == 0 and out.read_text() == before


def test_parquet_resume_onto_foreign_output_fails_cleanly(checkpoint_factory, tmp_path: Path) -> None:
    model = checkpoint_factory("llama")
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pd.DataFrame({"prompt": ["one", "two"]}).to_parquet(src)
    pd.DataFrame({"something": [1, 2, 3]}).to_parquet(out)  # not ours, no sidecar
    result = _run(model, src, out, "--resume")
    assert result.returncode == 2 and "--overwrite" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out.parquet.parts").exists()
    assert pd.read_parquet(out).columns.tolist() == ["something"]
