"""--resume refuses outputs made from another input, and a failed adoption leaves no trace.

The CLI runs in this process (``main``): a refusal is a return code and a message, never a raise."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from batchgen.cli import main


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]):
    def _run(model: Path, src: Path, out: Path, *extra: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main(["run", "--model", str(model), "--input", str(src), "--output", str(out), "--progress", "off",
                     "--max-tokens", "2", *extra])
        return code, capsys.readouterr().err
    return _run


def _jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": p}}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_resume_with_another_input_is_refused(checkpoint_factory, tmp_path: Path, run) -> None:
    model = checkpoint_factory("llama")
    first, other, out = _jsonl(tmp_path / "a.jsonl", ["one", "two"]), _jsonl(tmp_path / "b.jsonl", ["x"]), \
        tmp_path / "out.jsonl"
    assert run(model, first, out)[0] == 0
    before = out.read_text()
    code, err = run(model, other, out, "--resume")
    assert code == 2 and "started from another input" in err
    assert out.read_text() == before
    assert run(model, first, out, "--resume")[0] == 0 and out.read_text() == before


def test_parquet_resume_onto_foreign_output_fails_cleanly(checkpoint_factory, tmp_path: Path, run) -> None:
    model = checkpoint_factory("llama")
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pd.DataFrame({"prompt": ["one", "two"]}).to_parquet(src)
    pd.DataFrame({"something": [1, 2, 3]}).to_parquet(out)  # not ours, no sidecar
    code, err = run(model, src, out, "--resume")
    assert code == 2 and "--overwrite" in err
    assert not (tmp_path / "out.parquet.parts").exists()
    assert pd.read_parquet(out).columns.tolist() == ["something"]
