"""The CUDA decode dispatch (models/cuda_decode.py) run on CPU: the Triton paged-attention
kernel in Triton's interpreter (the compiled CPU kernel turned off), forced on in place of the
torch decode path, still gives
transformers' greedy tokens (GQA with and without q/k norm, MLA with and without q_lora_rank)."""
from __future__ import annotations

import os

import pytest
import tiny_models
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import batchgen.models.attention as attention  # noqa: E402
from batchgen import Engine, SamplingParams  # noqa: E402
from batchgen_kernels import triton_available  # noqa: E402

MAX_TOKENS = 5


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_paged_kernel_decode_matches_transformers(arch: str, checkpoint_factory, prompt_ids,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def forced(device: torch.device, dtype: torch.dtype | None = None) -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(attention, "use_paged_kernel", forced)
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")  # the Triton kernel, not the compiled CPU one
    model_dir = checkpoint_factory(arch)
    engine = Engine(model_dir, dtype="float32", device="cpu", block_size=5, kv_cache_bytes=4 << 20)
    prompts = [prompt_ids[0], prompt_ids[3], prompt_ids[-1]]  # short, middling, longest
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert calls, "the paged-kernel dispatch was never consulted"
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == tiny_models.reference_generate(model_dir, prompt, MAX_TOKENS, ignore_eos=True), \
            f"{arch}: prompt of {len(prompt)} tokens"
