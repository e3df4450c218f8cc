"""Small stateless building blocks shared by every family."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen_kernels.cpu_rms_norm import rms_norm_kernel_for, rms_norm_reference, rms_norm_unchecked
from batchgen_kernels.tiled_linear import linear

from .weights import MLPWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32 then scale in the input dtype, as transformers' *RMSNorm does."""
    lib = rms_norm_kernel_for(x.dtype, x.shape[-1]) if x.device.type == "cpu" and weight.dtype == x.dtype else None
    if lib is not None:
        # one compiled pass a row with torch's floats (checked once per dtype and width), where
        # torch's runs several operators, each a pass over the rows
        return rms_norm_unchecked(lib, x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # one fused op instead of seven, bit-identical in fp32 (tests/engine/test_rms_norm.py).
        # On CPU the weight is applied after it: torch's fused op with a weight ran 10-20x
        # slower on prompt-sized batches (10 ms against 0.5 ms at 2048 x 1024, two threads)
        if x.device.type == "cpu":
            return F.rms_norm(x, (x.shape[-1],), None, eps).mul_(weight)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_reference(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def mlp(x: torch.Tensor, w: MLPWeights) -> torch.Tensor:
    """x: [T, H] -> [T, H]; SwiGLU."""
    return linear(silu_mul(linear(x, w.gate_up, w.gate_up_bias)), w.down, w.down_bias)
