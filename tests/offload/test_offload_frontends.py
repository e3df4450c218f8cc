"""Expert budgets through the front ends: `batchgen run --expert-memory/--expert-host-memory`
(human sizes; the progress line shows the hit rates) and `batchgen.generate`."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from batchgen import Engine, SamplingParams
from batchgen.cli import main
from batchgen.cluster import generate
from batchgen.progress import Progress

GREEDY = {"temperature": 0.0, "ignore_eos": True}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory) -> Path:
    return checkpoint_factory("qwen3_moe")


def one_layer_kib(engine: Engine) -> int:
    ffn = next(layer.ffn for layer in engine.model.weights.layers if getattr(layer.ffn, "w13", None) is not None)
    nbytes = (ffn.w13[0].numel() + ffn.w2[0].numel()) * ffn.w13.element_size() * ffn.w13.shape[0]
    return -(-nbytes // 1024)


def test_batchgen_run_takes_expert_budgets_and_shows_hit_rates(ckpt: Path, tmp_path: Path, capsys) -> None:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": " ".join(WORDS[i % 7:i % 7 + 3]), "max_tokens": 6, **GREEDY}})
             for i in range(12)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    plain, tiered = tmp_path / "plain.jsonl", tmp_path / "tiered.jsonl"
    assert main(["run", "--model", str(ckpt), "--input", str(src), "--output", str(plain), "--progress", "off"]) == 0
    kib = one_layer_kib(Engine(ckpt))
    assert main(["run", "--model", str(ckpt), "--input", str(src), "--output", str(tiered), "--progress", "lines",
                 "--expert-host-memory", f"{kib}KiB"]) == 0
    err = capsys.readouterr().err
    assert "experts: " in err and "% in pool" in err and "MiB/token moved" in err

    def texts(path: Path) -> dict[str, str]:
        return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"]
                for r in map(json.loads, path.read_text().splitlines())}
    assert texts(tiered) == texts(plain) and len(texts(plain)) == 12


def test_batchgen_run_refuses_a_bad_size_or_too_small_a_budget(ckpt: Path, tmp_path: Path, capsys) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "alpha"}}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--model", str(ckpt), "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
              "--expert-memory", "plenty"])
    assert exit_info.value.code == 2 and "must be a byte count or a size like '2GiB'" in capsys.readouterr().err
    code = main(["run", "--model", str(ckpt), "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                 "--expert-host-memory", "1KiB"])
    assert code == 2 and "expert_host_memory_bytes=1024 cannot hold one MoE layer's" in capsys.readouterr().err


def test_generate_takes_the_same_budgets(ckpt: Path, prompt_ids) -> None:
    pdf = pd.DataFrame({"prompt": [" ".join(WORDS[i:i + 4]) for i in range(6)]})
    plain = generate(pdf, model=ckpt, max_tokens=6, **GREEDY)
    kib = one_layer_kib(Engine(ckpt))
    tiered = generate(pdf, model=ckpt, max_tokens=6, expert_host_memory=f"{kib} KiB", **GREEDY)
    assert tiered["generated_text"].tolist() == plain["generated_text"].tolist()
    with pytest.raises(TypeError, match="given twice"):
        generate(pdf, model=ckpt, expert_memory="1GiB", engine_options={"expert_memory_bytes": 5})


def test_progress_line_carries_a_status() -> None:
    bar = Progress(10, mode="off", status=lambda: "experts: 50% in pool")
    bar.update(3, 12)
    assert bar.snapshot().line().endswith(" | experts: 50% in pool")
    assert not Progress(10, mode="off").snapshot().line().endswith(" | ")  # no status, no empty field


def test_expert_status_is_empty_when_every_expert_is_resident(ckpt: Path) -> None:
    resident = Engine(ckpt)
    resident.generate(["alpha beta"], SamplingParams(max_tokens=4, **GREEDY))
    assert resident.expert_status() == ""
    tiered = Engine(ckpt, expert_host_memory_bytes=one_layer_kib(resident) * 1024)
    assert tiered.expert_status() == ""  # nothing fetched yet
    tiered.generate(["alpha beta"], SamplingParams(max_tokens=4, **GREEDY))
    assert tiered.expert_status().startswith("experts: ") and "% in pool" in tiered.expert_status()
