"""``--resume`` cannot mix two jobs: it refuses another model, another temperature, an input
edited in the middle and another batchgen version, naming each change; ``--force-resume``
overrides. ``--retry-errors`` reruns exactly the rows that ended in a retryable error."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from demo_builder import build_demo_model

from batchgen.cli import main
from batchgen.io.faults import JobAborted
from batchgen.io.job import run_job
from batchgen.io.jsonl_sink import JsonlSink
from batchgen.io.openai_batch import record_error, record_key
from batchgen.io.request import Request
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

TINY: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                            intermediate_size=64, vocab_size=320, max_position_embeddings=128, dtype="float32")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.getbasetemp()
    return (build_demo_model(base / "resume-a", **TINY), build_demo_model(base / "resume-b", seed=1, **TINY))


def _input(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": p}}) + "\n" for i, p in enumerate(prompts)))
    return path


def _run(model: Path, src: Path, out: Path, *extra: str) -> int:
    return main(["run", "--model", str(model), "--input", str(src), "--output", str(out), "--max-tokens", "2",
                 "--temperature", "0", "--progress", "off", *extra])


PROMPTS = ["alpha beta", "gamma", "delta epsilon zeta", "eta theta"]


@pytest.mark.parametrize("change", ["model", "temperature", "edited input", "version"])
def test_resume_refuses_another_job_naming_the_change(models: tuple[Path, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str], change: str) -> None:
    a, b = models
    src, out = _input(tmp_path / "in.jsonl", PROMPTS), tmp_path / "out.jsonl"
    assert _run(a, src, out) == 0
    before = out.read_text()
    capsys.readouterr()
    model, extra = a, ["--resume"]
    if change == "model":
        model = b
    elif change == "temperature":
        extra += ["--temperature", "0.7"]
    elif change == "edited input":
        text = src.read_text()
        middle = len(text) // 2
        src.write_text(text[:middle] + ("x" if text[middle] != "x" else "y") + text[middle + 1:])
    else:
        sidecar = tmp_path / "out.jsonl.input.json"
        record = json.loads(sidecar.read_text())
        sidecar.write_text(json.dumps({**record, "batchgen_version": "0.0.1"}))
    assert _run(model, src, out, *extra) == 2
    err = capsys.readouterr().err
    named = {"model": "model model: files changed", "temperature": "options.sampling",
             "edited input": "input: started from another input", "version": "batchgen version: 0.0.1 ->"}[change]
    assert named in err and "--force-resume" in err, err
    if change == "temperature":
        assert "'temperature': 0.0" in err and "'temperature': 0.7" in err
    assert out.read_text() == before  # nothing written
    if change != "edited input":  # the override finishes it (here: nothing is left to run)
        assert _run(model, src, out, *extra, "--force-resume") == 0


def test_unchanged_resume_of_a_finished_output_is_a_no_op(models: tuple[Path, Path], tmp_path: Path) -> None:
    src, out = _input(tmp_path / "in.jsonl", PROMPTS), tmp_path / "out"
    assert _run(models[0], src, out) == 0
    parts = sorted(p.name for p in out.iterdir())
    assert _run(models[0], src, out, "--resume") == 0
    assert sorted(p.name for p in out.iterdir()) == parts


class _Echo:
    """A backend that answers each row with its prompt; ``fail_after``: then raises (a lost cluster)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.seen: list[list[int]] = []

    def run(self, requests: Iterable[Any], max_in_flight: int) -> Iterator[tuple[int, RequestOutput]]:
        pulled = []
        for position, (ids, _params) in enumerate(requests):
            pulled.append((position, ids))
            self.seen.append(ids)
            if len(pulled) < max_in_flight:
                continue
            if self.fail_after is not None and position >= self.fail_after:
                raise ConnectionError("scheduler lost")
            pos, got = pulled.pop(0)
            yield pos, RequestOutput(pos, got, got[:1], f"t{got[0]}", "length")
        for pos, got in pulled:
            yield pos, RequestOutput(pos, got, got[:1], f"t{got[0]}", "length")


def _requests(n: int) -> list[Request]:
    return [Request(key=("id", f"r{i}"), where=f"line {i + 1}", number=i + 1, custom_id=f"r{i}",
                    prompt_token_ids=[i + 1, 7], params=SamplingParams()) for i in range(n)]


def test_backend_failure_is_a_retryable_500_and_retry_errors_reruns_only_those(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    with pytest.raises(JobAborted):
        run_job(_requests(10), JsonlSink(path, model="m", resume=False), _Echo(fail_after=5), chunk_size=3)
    first = [json.loads(x) for x in path.read_text().splitlines()]
    failed = [r for r in first if record_error(r)]
    assert failed and all(r["response"]["status_code"] == 500 for r in failed)
    assert all(record_error(r)["type"] == "server_error" and record_error(r)["retryable"] for r in failed)

    # without --retry-errors the server errors count as done
    assert JsonlSink(path, model="m", resume=True).done == {record_key(r) for r in first}
    sink = JsonlSink(path, model="m", resume=True, retry=True)
    assert sink.done == {record_key(r) for r in first if not record_error(r)}
    backend = _Echo()
    summary = run_job([r for r in _requests(10) if r.key not in sink.done], sink, backend, chunk_size=3)
    assert summary.errors == 0 and summary.resumed == len(first) - len(failed)
    final = [json.loads(x) for x in path.read_text().splitlines()]
    keys = [record_key(r) for r in final]
    assert sorted(keys) == sorted({("id", f"r{i}") for i in range(10)}) and len(keys) == 10  # exactly once
    assert not any(record_error(r) for r in final)
    assert len(backend.seen) == 10 - (len(first) - len(failed))  # only the failed and unrun rows ran again
