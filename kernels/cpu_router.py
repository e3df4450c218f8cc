"""A MoE layer's router on CPU in one compiled call (csrc/router_cpu.cpp), and its torch
reference.

# T tokens, K hidden, E experts, A choices per token
logits = x W^T in fp32; scores = softmax (or sigmoid) of them; the A experts of the highest
scores (plus a correction bias where the model has one) are chosen, their scores are the weights,
renormalized to sum to one and scaled where the model asks. One call replaces seven or more torch
operators, most of the router's time at a decode step's rows. Grouped routing (DeepSeek's expert
groups) is not here: its callers keep torch's path.

The kernel sums each dot product in its own fixed order, not sgemm's: its weights agree with the
reference's within the product's rounding (a few 1e-6 relative at K = 1024-2048), and a token's
routing never depends on its batch.
"""
from __future__ import annotations

from typing import Any

import torch

from ._cpu_build import cpu_kernels, cpu_kernels_error
from .errors import CpuKernelUnavailableError, KernelInputError


def cpu_router_available() -> bool:
    """Whether the compiled router is usable here (built on first call)."""
    return cpu_kernels("router_cpu") is not None


def route_reference(x: torch.Tensor, router_w: torch.Tensor, top_k: int, sigmoid: bool = False,
                    normalize: bool = False, correction_bias: torch.Tensor | None = None,
                    scale: float = 1.0, renorm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, K]; router_w: [E, K] -> (weights [T, A] fp32, ids [T, A] int64), in torch.
    renorm_eps is added to the renormalizing sum (DeepSeek-V3 adds 1e-20)."""
    logits = torch.nn.functional.linear(x.float(), router_w.float())
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores + correction_bias if correction_bias is not None else scores
    return top_k_weights(scores, choice, top_k, normalize, scale, renorm_eps)


def top_k_weights(scores: torch.Tensor, choice: torch.Tensor, top_k: int, normalize: bool = False,
                  scale: float = 1.0, renorm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's last steps in torch: the top_k experts by `choice` [T, E] (the scores, plus a
    bias or with dropped groups masked), their `scores` as weights, renormalized and scaled ->
    (weights [T, A], ids [T, A])."""
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + renorm_eps)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, sigmoid: bool = False, normalize: bool = False,
          correction_bias: torch.Tensor | None = None, scale: float = 1.0,
          renorm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference`'s result: the compiled kernel where x is on the CPU and every operand is
    float32 and the kernel runs here, else the reference itself. Called for every MoE layer of
    every forward, so it checks only what the kernel needs and trusts the model's shapes."""
    lib = cpu_kernels("router_cpu") if x.device.type == "cpu" else None
    if (lib is None or x.dtype is not torch.float32 or x.dim() != 2 or router_w.dtype is not torch.float32
            or (correction_bias is not None and correction_bias.dtype is not torch.float32)):
        return route_reference(x, router_w, top_k, sigmoid, normalize, correction_bias, scale, renorm_eps)
    return route_unchecked(lib, x, router_w, top_k, sigmoid, normalize, correction_bias, scale, renorm_eps)


def route_cpu(x: torch.Tensor, router_w: torch.Tensor, top_k: int, sigmoid: bool = False,
              normalize: bool = False, correction_bias: torch.Tensor | None = None,
              scale: float = 1.0, renorm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference` in one compiled call: x [T, K] and router_w [E, K] (and the bias [E])
    CPU float32 tensors."""
    lib = cpu_kernels("router_cpu")
    if lib is None:
        raise CpuKernelUnavailableError(f"the CPU router is unavailable: {cpu_kernels_error('router_cpu')}")
    operands = {"x": x, "router_w": router_w, **({"correction_bias": correction_bias} if correction_bias is not None
                                                 else {})}
    for name, t in operands.items():
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise KernelInputError(f"{name} must be a CPU float32 tensor, got {t.dtype} on {t.device}")
    if x.dim() != 2 or router_w.dim() != 2 or x.shape[1] != router_w.shape[1]:
        raise KernelInputError(f"x must be [T, K] and router_w [E, K], got {tuple(x.shape)} and "
                               f"{tuple(router_w.shape)}")
    num_experts = router_w.shape[0]
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise KernelInputError(f"correction_bias must be [{num_experts}], got {tuple(correction_bias.shape)}")
    if not 1 <= top_k <= num_experts:
        raise KernelInputError(f"top_k must be in [1, {num_experts}], got {top_k}")
    return route_unchecked(lib, x, router_w, top_k, sigmoid, normalize, correction_bias, scale, renorm_eps)


def route_unchecked(lib: Any, x: torch.Tensor, router_w: torch.Tensor, top_k: int, sigmoid: bool, normalize: bool,
                    correction_bias: torch.Tensor | None, scale: float,
                    renorm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel call on operands as route_cpu checks them."""
    if x.shape[0] and x.stride(1) != 1:
        x = x.contiguous()
    router_w = router_w.contiguous()
    bias = correction_bias.contiguous() if correction_bias is not None else None
    T = x.shape[0]
    weights = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    if T:
        lib.batchgen_route(torch.get_num_threads(), x.data_ptr(), x.stride(0), router_w.data_ptr(),
                           None if bias is None else bias.data_ptr(), T,
                           x.shape[1], router_w.shape[0], top_k, int(sigmoid), int(normalize),
                           renorm_eps, scale, weights.data_ptr(), ids.data_ptr())
    return weights, ids
