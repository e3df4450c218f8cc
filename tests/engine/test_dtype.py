"""dtype="auto" (vLLM's rule): the checkpoint's dtype on CUDA, float32 on CPU; the default."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen import Engine
from batchgen.config import EngineConfig
from batchgen.errors import UnsupportedModelError
from batchgen.models.dtype import auto_dtype_name, checkpoint_dtype_name, resolve_dtype


@pytest.mark.parametrize("cfg, name", [
    ({"dtype": "bfloat16"}, "bfloat16"),           # transformers 5
    ({"torch_dtype": "float16"}, "float16"),       # older snapshots
    ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"),  # the newer key wins
    ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"),
    ({}, None),
    ({"torch_dtype": "float8_e4m3fn"}, None),
    ({"torch_dtype": None}, None),
])
def test_checkpoint_dtype_from_config(cfg: dict, name: str | None) -> None:
    assert checkpoint_dtype_name(cfg) == name


def test_auto_picks_the_checkpoint_dtype_on_cuda_and_float32_on_cpu() -> None:
    bf16, fp16, fp32 = {"dtype": "bfloat16"}, {"torch_dtype": "float16"}, {"torch_dtype": "float32"}
    assert auto_dtype_name(bf16, "cuda") == "bfloat16"
    assert auto_dtype_name(fp16, "cuda") == "float16"
    assert auto_dtype_name(fp32, "cuda") == "float32"
    assert auto_dtype_name({}, "cuda") == "float32"  # no dtype named: transformers' default
    assert auto_dtype_name(bf16, "cuda", bf16_supported=False) == "float16"  # pre-Ampere, as vLLM
    for cfg in (bf16, fp16, fp32, {}):
        assert auto_dtype_name(cfg, "cpu") == "float32"


def test_resolve_dtype() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", {"dtype": "bfloat16"}, cpu) is torch.float32
    assert resolve_dtype("bf16", {"dtype": "float32"}, cpu) is torch.bfloat16  # explicit wins
    assert resolve_dtype(torch.float16, {}, cpu) is torch.float16
    with pytest.raises(UnsupportedModelError, match="'int8' is not supported"):
        resolve_dtype("int8", {}, cpu)


def test_auto_is_the_default() -> None:
    assert EngineConfig().dtype == "auto"


def _bf16_checkpoint(src: Path, tmp_path: Path) -> Path:
    """The fp32 tiny checkpoint's files under a config.json that says bfloat16."""
    model = tmp_path / "bf16"
    model.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text()) | {"dtype": "bfloat16"}
    (model / "config.json").write_text(json.dumps(cfg))
    return model


def test_auto_engine_on_cpu_computes_in_float32(checkpoint_factory, tmp_path: Path) -> None:
    engine = Engine(_bf16_checkpoint(checkpoint_factory("mixtral"), tmp_path), device="cpu", kv_cache_bytes=1 << 20)
    assert engine.model.dtype is torch.float32
    assert engine.executor.cache.dtype is torch.float32


@pytest.mark.cuda
def test_auto_engine_on_cuda_computes_in_the_checkpoint_dtype(checkpoint_factory, tmp_path: Path) -> None:
    engine = Engine(_bf16_checkpoint(checkpoint_factory("mixtral"), tmp_path), device="cuda", kv_cache_bytes=1 << 24)
    want = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    assert engine.model.dtype is want
    assert engine.executor.cache.dtype is want
