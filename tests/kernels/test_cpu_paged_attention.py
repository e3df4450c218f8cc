"""The compiled CPU paged decode attention (batchgen_kernels.cpu_paged_attention) against the
plain-torch reference at awkward sizes (GQA, MHA, MQA, sliding windows, MLA's latent, odd block
sizes, bfloat16), its input errors, and the engine's fallback to the torch path when the kernel
cannot be built."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import batchgen_kernels as K
from batchgen.models.cuda_decode import use_paged_kernel
from batchgen_kernels import _cpu_build

needs_kernel = pytest.mark.skipif(not K.cpu_paged_attention_available(),
                                  reason=f"CPU kernel unavailable: {_cpu_build.cpu_kernels_error()}")
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def paged_inputs(S: int, hq: int, width: int, q_width: int, block_size: int, max_len: int, dtype: torch.dtype,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> q [S, Hq, q_width], cache [slots, width], block_tables [S, MB] (shuffled blocks, so
    slots are out of order; unused columns 0), context_lens [S] (1 .. max_len)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (S,), generator=g)
    lens[0] = max_len
    mb = -(-max_len // block_size)
    num_blocks = S * mb + 2
    cache = torch.randn(num_blocks * block_size, width, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:S * mb].view(S, mb).to(torch.int32)
    for s, n in enumerate(lens.tolist()):
        tables[s, -(-n // block_size):] = 0
    return torch.randn(S, hq, q_width, generator=g).to(dtype), cache, tables, lens


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,hq,hk,d,block_size,max_len,window", [
    (1, 1, 1, 1, 1, 1, None),
    (3, 4, 2, 32, 16, 40, None),
    (3, 6, 3, 17, 5, 33, 7),  # odd head dim, block size and window
    (257, 8, 2, 64, 16, 70, None),
    (5, 8, 8, 128, 32, 300, 33),  # MHA, window across blocks
    (4, 12, 1, 24, 3, 50, 1),  # MQA, window of one position
    (6, 8, 2, 64, 13, 90, 20),  # blocks of 13 keys (8 + 4 + 1 at a time), window across blocks
])
def test_gqa_matches_reference(dtype: torch.dtype, S: int, hq: int, hk: int, d: int, block_size: int, max_len: int,
                               window: int | None) -> None:
    q, cache, tables, lens = paged_inputs(S, hq, 2 * hk * d, d, block_size, max_len, dtype, seed=S + d)
    args = (q, cache, tables, lens, block_size, hk, d ** -0.5, window)
    out = K.paged_attention_gqa_cpu(*args)
    assert out.dtype == dtype and out.shape == (S, hq, d)
    torch.testing.assert_close(out.float(), K.paged_attention_gqa_reference(*args).float(), **TOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,hq,rank,rope,block_size,max_len", [(1, 1, 4, 2, 1, 3), (3, 5, 32, 8, 7, 45),
                                                                (17, 16, 64, 16, 16, 129)])
def test_mla_matches_reference(dtype: torch.dtype, S: int, hq: int, rank: int, rope: int, block_size: int,
                               max_len: int) -> None:
    q, cache, tables, lens = paged_inputs(S, hq, rank + rope, rank + rope, block_size, max_len, dtype, seed=S)
    args = (q, cache, tables, lens, block_size, rank, 0.3)
    out = K.paged_attention_mla_cpu(*args)
    assert out.shape == (S, hq, rank)
    torch.testing.assert_close(out.float(), K.paged_attention_mla_reference(*args).float(), **TOL[dtype])


@needs_kernel
def test_strided_query_and_long_context() -> None:
    """q as a view into a wider projection (the engine hands it such rows); a context of 1000."""
    q, cache, tables, lens = paged_inputs(2, 4, 2 * 2 * 16, 16, 16, 1000, torch.float32, seed=1)
    wide = torch.randn(2, 7, 16)
    wide[:, 1:5] = q
    out = K.paged_attention_gqa_cpu(wide[:, 1:5], cache, tables, lens, 16, 2, 0.25)
    torch.testing.assert_close(out, K.paged_attention_gqa_reference(q, cache, tables, lens, 16, 2, 0.25),
                               **TOL[torch.float32])


@needs_kernel
def test_bad_inputs_name_the_problem() -> None:
    q, cache, tables, lens = paged_inputs(3, 4, 32, 8, 4, 10, torch.float32, seed=2)
    bad = tables.clone()
    bad[1, 0] = cache.shape[0] // 4  # one past the last block
    with pytest.raises(K.KernelInputError, match="sequence 1"):
        K.paged_attention_gqa_cpu(q, cache, bad, lens, 4, 2, 1.0)
    with pytest.raises(K.KernelInputError, match="sequence 2"):
        K.paged_attention_gqa_cpu(q, cache, tables, torch.tensor([1, 2, 100]), 4, 2, 1.0)
    with pytest.raises(K.KernelInputError, match="float32 or bfloat16"):
        K.paged_attention_gqa_cpu(q.half(), cache.half(), tables, lens, 4, 2, 1.0)
    with pytest.raises(K.KernelInputError, match="2 \\* 3 kv heads"):
        K.paged_attention_gqa_cpu(q, cache, tables, lens, 4, 3, 1.0)


def test_engine_falls_back_when_the_kernel_cannot_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        checkpoint_factory, prompt_ids) -> None:
    """A failed build is reported, decode takes the torch path, and greedy tokens do not change."""
    from batchgen import Engine, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    model_dir = checkpoint_factory("mixtral")
    prompts = [prompt_ids[0], prompt_ids[-1]]
    with_kernel = Engine(model_dir, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    for name in ("paged_attention_cpu", "rope_kv_cpu", "small_rows_cpu"):
        (tmp_path / f"{name}.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(_cpu_build, "_CSRC", tmp_path)
    monkeypatch.setattr(_cpu_build, "_state", {})
    monkeypatch.setenv("BATCHGEN_KERNEL_CACHE", str(tmp_path / "cache"))
    assert not K.cpu_paged_attention_available()
    assert "building the CPU kernels failed" in (_cpu_build.cpu_kernels_error() or "")
    assert not use_paged_kernel(torch.device("cpu"), torch.float32)
    assert not K.cpu_rope_kv_available()
    assert not K.cpu_small_rows_available()
    with pytest.raises(K.CpuKernelUnavailableError, match="unavailable"):
        K.paged_attention_gqa_cpu(*paged_inputs(1, 2, 4, 1, 1, 1, torch.float32, 0), 1, 2, 1.0)
    without = Engine(model_dir, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    assert [o.token_ids for o in with_kernel] == [o.token_ids for o in without]


def test_turned_off_and_unsupported_dtypes_use_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert not use_paged_kernel(cpu, torch.float16)
    assert not use_paged_kernel(cpu)  # dtype unknown: the torch path
    monkeypatch.setenv("BATCHGEN_CPU_KERNELS", "0")
    assert not use_paged_kernel(cpu, torch.float32)
    assert "BATCHGEN_CPU_KERNELS=0" in (_cpu_build.cpu_kernels_error() or "")
