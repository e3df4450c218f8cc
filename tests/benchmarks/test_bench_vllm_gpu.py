"""bench_vllm's --device cuda path (both engines on a GPU, in turns): its arguments refused where
they cannot run, and its pairs, ratios and token comparison with the engines moved onto the CPU
(this suite has no GPU; vLLM is faked by a second batchgen run, and both report fixed times)."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
bench_vllm = importlib.import_module("bench_vllm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: the refusal is for machines without")
def test_cuda_is_refused_without_a_device_and_with_cpu_only_options() -> None:
    for extra, message in (([], "torch here sees no CUDA device"),
                           (["--breakdown"], "runs batchgen and vLLM only"),
                           (["--vllm-python", "/no/such/python"], "--vllm-python: no file /no/such/python")):
        done = subprocess.run([sys.executable, str(BENCH / "bench_vllm.py"), "--device", "cuda", *extra],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_the_cuda_path_alternates_pairs_and_compares_tokens(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    run_batchgen = bench_vllm.run_batchgen
    calls: list[str] = []

    def on_cpu(model_dir, prompts, lengths, **options):  # what gpu_main asks of batchgen, run here
        assert options.pop("device") == "cuda" and options.pop("gpu_memory_utilization") == bench_vllm.CUDA_MEMORY_SHARE
        calls.append("batchgen")
        _, stats, tokens = run_batchgen(model_dir, prompts, lengths, device="cpu", **options)
        return 1.0, stats, tokens  # (seconds fixed: the report's arithmetic, not this machine's speed)

    def vllm(python, model_dir, prompts, lengths, threads, work, dtype, cuda=False):
        assert cuda and python == Path(sys.executable)
        calls.append("vllm")
        _, _, tokens = run_batchgen(model_dir, prompts, lengths, dtype=dtype, device="cpu")
        return 2.0, tokens

    monkeypatch.setattr(bench_vllm, "run_batchgen", on_cpu)
    monkeypatch.setattr(bench_vllm, "run_vllm", vllm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a test GPU")
    monkeypatch.setattr(sys, "argv", ["bench_vllm.py", "--device", "cuda", "--model", "small", "--rows", "6",
                                      "--pairs", "2", "--check-rows", "2", "--vllm-python", sys.executable])
    bench_vllm.main()
    out = capsys.readouterr().out
    assert calls == ["batchgen", "vllm", "batchgen", "batchgen", "vllm"]  # warm-up, then the pairs alternated
    assert "small model on a test GPU, float32; 6 rows" in out
    assert "batchgen / vLLM per pair: 2.00x, 2.00x; median 2.00x" in out  # vLLM's fake takes twice as long
    assert "batchgen :    " in out and "vLLM     :    " in out
    assert "equals transformers (CPU, float32) on 2/2 checked rows; vLLM equals batchgen on 6/6 rows" in out
