"""Sampling: per-request settings and the batched sampler (see docs/CONTRACTS.md).

Torch-free code (sequence state, policy, simulator) should import ``batchgen.sampling_params``
directly; this module also pulls in the torch sampler.
"""
from __future__ import annotations

from batchgen.sampler import (
    SampleResult,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    exponential_noise,
    sample,
    step_seed,
)
from batchgen.sampling_params import (
    GREEDY_EPS,
    MAX_LOGPROBS,
    SamplingParams,
    find_stop_span,
    find_stop_string,
)

__all__ = [
    "GREEDY_EPS", "MAX_LOGPROBS", "SampleResult", "SamplingParams", "apply_min_p",
    "apply_penalties", "apply_top_k_top_p", "exponential_noise", "find_stop_span",
    "find_stop_string", "sample", "step_seed",
]
