"""Launchers of the Triton fused MoE (vLLM-style): check inputs, pick a launch config, compute
grids. The kernels live in `_triton_moe.py`, imported on first use so that this module, and the
package, import without triton; the semantics are `reference.py`'s.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ._checks import check_moe_inputs, check_topk_ids
from .config import get_config, validate_config
from .errors import KernelInputError, TritonUnavailableError
from .reference import moe_align_sizes

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_available() -> bool:
    """Whether triton imports here (not whether a GPU is present: see `fused_moe`)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _kernels() -> ModuleType:
    try:
        return importlib.import_module("._triton_moe", __package__)
    except ImportError as exc:
        raise TritonUnavailableError(
            "fused_moe needs triton (pip install triton; a CUDA GPU, or TRITON_INTERPRET=1 set "
            "before triton is imported for the CPU interpreter); without it use "
            f"fused_moe_reference. Import failed with: {exc}"
        ) from exc


def _interpreting(kernels: ModuleType) -> bool:
    # The jit decorator picked interpreter or compiler when the kernels were imported.
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernels.moe_gemm_kernel, InterpretedFunction)


def _check_device(kernels: ModuleType, name: str, t: torch.Tensor) -> None:
    if t.is_cuda or _interpreting(kernels):
        return
    raise KernelInputError(
        f"{name} is on device {t.device}; the Triton kernels need CUDA tensors (on CPU use "
        f"fused_moe_reference, or set TRITON_INTERPRET=1 before importing triton)"
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def moe_align_triton(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `moe_align`: same outputs, bit for bit (see `reference.moe_align`).

    # T tokens, A active per token, S = T*A slots, E experts, B block_size
    topk_ids: [T, A] int32/int64 (copied if not contiguous). Returns sorted_token_ids:
    [max_num_tokens_padded], expert_ids: [max_num_blocks], num_tokens_post_padded: [1], int32.
    """
    kernels = _kernels()
    check_topk_ids(topk_ids)
    _check_device(kernels, "topk_ids", topk_ids)
    topk_ids = topk_ids.contiguous()
    if num_experts < 1 or block_size < 1:
        raise KernelInputError(
            f"num_experts and block_size must be >= 1, got {num_experts} and {block_size}"
        )
    E, S, device = num_experts, topk_ids.numel(), topk_ids.device
    if S >= 2**31 - 1:
        raise KernelInputError(f"topk_ids has {S} slots; int32 indices need < 2**31 - 1")
    max_padded, max_blocks = moe_align_sizes(S, E, block_size)
    sorted_ids = torch.full((max_padded,), S, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post = torch.zeros(1, dtype=torch.int32, device=device)
    if S == 0:
        return sorted_ids, expert_ids, num_post

    e_pad = max(2, _next_pow2(E))
    # The one-hot [CHUNK, E_PAD] tile must stay small enough for registers.
    chunk = max(16, min(1024, 8192 // e_pad))
    num_chunks = _cdiv(S, chunk)
    chunk_counts = torch.empty(num_chunks, E, dtype=torch.int32, device=device)
    chunk_base = torch.empty(num_chunks, E, dtype=torch.int32, device=device)
    kernels.align_count_kernel[(num_chunks,)](
        topk_ids, chunk_counts, S, E, CHUNK=chunk, E_PAD=e_pad,
    )
    kernels.align_offsets_kernel[(1,)](
        chunk_counts, chunk_base, expert_ids, num_post, num_chunks, E, max_blocks, block_size,
        E_PAD=e_pad, BLOCKS=max(16, 4096 // e_pad),
    )
    kernels.align_scatter_kernel[(num_chunks,)](
        topk_ids, chunk_base, sorted_ids, S, E, CHUNK=chunk, E_PAD=e_pad,
    )
    return sorted_ids, expert_ids, num_post


def _check_layout(kernels: ModuleType, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    if x.dtype not in _TRITON_DTYPES:
        raise KernelInputError(f"x must be float16, bfloat16 or float32, got dtype {x.dtype}")
    _check_device(kernels, "x", x)
    if x.dtype == torch.bfloat16 and _interpreting(kernels):
        # The interpreter stores bf16 as uint16 and its tl.dot multiplies the raw bits
        # (triton-lang/triton#11584; bf16 is documented as unsupported there).
        raise KernelInputError("x has dtype bfloat16, which Triton's interpreter does not support; "
                               "use float16/float32 there, or run on CUDA")
    if not x.is_contiguous():
        raise KernelInputError(f"x must be contiguous, got strides {x.stride()}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise KernelInputError(
                f"{name} must have unit stride in its last dim, got strides {t.stride()}"
            )


def _launch_gemm(kernels: ModuleType, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 topk_weights: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 *, top_k: int, gated: bool, mul_routed_weight: bool, config: dict[str, int]) -> None:
    # a: [*, K] (rows = slot // top_k); b: [E, N or 2N, K]; c: [S, N]
    sorted_ids, expert_ids, num_post = align
    n_out, k_in = c.shape[1], a.shape[1]
    em = sorted_ids.numel()
    grid = (_cdiv(em, config["BLOCK_SIZE_M"]) * _cdiv(n_out, config["BLOCK_SIZE_N"]),)
    kernels.moe_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_post,
        n_out, k_in, em, topk_weights.numel(),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        BLOCK_SIZE_M=config["BLOCK_SIZE_M"], BLOCK_SIZE_N=config["BLOCK_SIZE_N"],
        BLOCK_SIZE_K=config["BLOCK_SIZE_K"], GROUP_SIZE_M=config["GROUP_SIZE_M"],
        TOP_K=top_k, GATED=gated, MUL_ROUTED_WEIGHT=mul_routed_weight,
        FP32_IEEE=a.dtype == torch.float32,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Triton fused MoE; same result as `fused_moe_reference` up to rounding.

    # T tokens, E experts, A active per token, K hidden, N expert intermediate, S = T*A slots
    x: [T, K] contiguous fp16/bf16/fp32 on CUDA; w13: [E, 2N, K], w2: [E, K, N] with unit
    last stride; topk_weights: [T, A] float; topk_ids: [T, A] int32/int64 (both copied if not
    contiguous). Returns [T, K].

    Steps: align slots into expert blocks of BLOCK_SIZE_M (`moe_align_triton`); GEMM 1 over
    the blocks with w13 and SiLU-and-mul fused in its epilogue -> [S, N]; GEMM 2 with w2, scaled
    by the routing weight -> [S, K]; sum over A. Accumulation is fp32; the [S, N] and [S, K]
    intermediates are stored in x's dtype. config: a launch config (see `config.py`); default
    `get_config(E, N, K, T, dtype)`.
    """
    kernels = _kernels()
    T, K, E, N, A = check_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    _check_layout(kernels, x, w13, w2)
    # [T, A] routing tensors are tiny: copy rather than refuse a strided view (e.g. a slice).
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    if config is None:
        device_name = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
        config = get_config(E, N, K, T, x.dtype, device_name=device_name)
    else:
        config = validate_config(config)
    if T * A == 0:
        return x.new_zeros(T, K)

    align = moe_align_triton(topk_ids, E, config["BLOCK_SIZE_M"])
    S = T * A
    hidden = torch.empty(S, N, dtype=x.dtype, device=x.device)
    _launch_gemm(kernels, x, w13, hidden, topk_weights, align,
                 top_k=A, gated=True, mul_routed_weight=False, config=config)
    # Zeroed: slots whose expert id is outside [0, E) are in no block and must add nothing.
    expert_out = torch.zeros(S, K, dtype=x.dtype, device=x.device)
    _launch_gemm(kernels, hidden, w2, expert_out, topk_weights, align,
                 top_k=1, gated=False, mul_routed_weight=True, config=config)
    return expert_out.view(T, A, K).sum(dim=1)

