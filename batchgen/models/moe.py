"""MoE stage: router (softmax/sigmoid, grouped top-k, correction bias, scaling) and experts.

The expert computation itself lives in `batchgen_kernels` (Triton on CUDA, the tiled CPU kernel
for experts a CPU model keeps in tiles, grouped GEMMs over expert-sorted tokens elsewhere, each
checked against the torch reference); this module only decides which tokens go where and with
what weight.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from batchgen_kernels import fused_moe, fused_moe_grouped, fused_moe_grouped_into, triton_available
from batchgen_kernels.cpu_router import route as route_top_k
from batchgen_kernels.cpu_router import top_k_weights
from batchgen_kernels.expert_tiles import moe_tiled_cpu

from .layers import mlp
from .spec import MoESpec, RouterSpec
from .weights import MoEWeights


def route(x: torch.Tensor, router_w: torch.Tensor, r: RouterSpec,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] -> (topk_weights [T, A] fp32, topk_ids [T, A] int64). Routing runs in fp32."""
    renorm_eps = 1e-20 if r.has_correction_bias else 0.0  # (DeepSeek-V3's)
    if r.num_groups == 1:  # on the CPU one compiled call (batchgen_kernels.cpu_router)
        return route_top_k(x.float(), router_w, r.top_k, r.scoring == "sigmoid", r.norm_topk_prob, correction_bias,
                           r.routed_scaling_factor, renorm_eps)
    # grouped routing (DeepSeek's expert groups): the groups' scores pick the groups first
    logits = F.linear(x.float(), router_w)  # [T, E]
    scores = logits.softmax(dim=-1) if r.scoring == "softmax" else logits.sigmoid()
    choice = scores + correction_bias if correction_bias is not None else scores
    T, E, G = x.shape[0], r.num_experts, r.num_groups
    grouped = choice.view(T, G, E // G)
    if r.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep_groups = group_scores.topk(r.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
    keep = keep.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
    # deepseek_v2 zeroes the dropped groups' softmax scores; v3 (sigmoid + bias) sets them to -inf
    choice = choice.masked_fill(~keep, float("-inf") if r.group_score == "top2sum" else 0.0)
    return top_k_weights(scores, choice, r.top_k, r.norm_topk_prob, r.routed_scaling_factor, renorm_eps)


# topk_ids -> parts (w13, w2, ids remapped to pool slots, -1 for experts not in this part)
ExpertFetch = Callable[[torch.Tensor], Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]


def moe(x: torch.Tensor, w: MoEWeights, spec: MoESpec,
        on_route: Callable[[torch.Tensor], None] | None = None, fetch: ExpertFetch | None = None) -> torch.Tensor:
    """x: [T, H] (already normed) -> [T, H]: routed experts plus the shared expert, if any.

    on_route receives topk_ids [T, A] (the runtime counts tokens per expert call with it).
    fetch: for experts kept outside the device, topk_ids -> parts of a device pool that hold
    every expert those ids need between them (batchgen.offload.ExpertStore.fetch_parts): each
    part's experts are computed as it arrives, into one slot buffer summed at the end, which is
    exactly the one-call result.
    """
    weights, ids = route(x, w.router, spec.router, w.correction_bias)
    if on_route is not None:
        on_route(ids)
    experts = fused_moe if x.is_cuda and triton_available() else fused_moe_grouped
    if w.tiles is not None:
        out = moe_tiled_cpu(x.contiguous(), w.tiles, weights.to(x.dtype).contiguous(), ids.contiguous())
    elif fetch is None:
        assert w.w13 is not None and w.w2 is not None
        out = experts(x, w.w13, w.w2, weights.to(x.dtype), ids)
    elif x.is_cuda and triton_available():
        (w13, w2, slot_ids), = fetch(ids)  # one part on CUDA: copies are ordered on the stream
        out = experts(x, w13, w2, weights.to(x.dtype), slot_ids)
    else:
        T, A = ids.shape
        slot_out = x.new_zeros(T * A, x.shape[1])
        for w13, w2, slot_ids in fetch(ids):
            fused_moe_grouped_into(slot_out, x, w13, w2, weights.to(x.dtype), slot_ids)
        out = slot_out.view(T, A, -1).sum(dim=1)
    if w.shared is not None:
        shared = mlp(x, w.shared)
        if w.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, w.shared_gate)) * shared
        out = out + shared
    return out
