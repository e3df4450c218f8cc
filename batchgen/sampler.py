"""One decode step's token choice for a batch, with vLLM's semantics.

Order, as in vLLM's v1 sampler: logprobs from the raw logits; min_tokens masks stop/eos ids;
repetition / frequency / presence penalties; greedy rows take the argmax; the other rows divide by
temperature, then min_p, then top_k and top_p (top_p over the renormalised survivors), and draw by
the exponential race argmax(probs / q), q ~ Exponential(1).

Each random row's q comes from a CPU generator seeded by (seed, step) alone, so a request's
tokens do not depend on its batch company, its row, or where it was suspended and resumed.
Rows are assumed to hold valid params (``SamplingParams.validate`` ran at admission).

Structured outputs: a row with a grammar gets its token mask first (disallowed ids -inf, as
vLLM applies the grammar bitmask to the logits before its sampler); rows without are untouched.
A masked token has probability 0, so the race above picks among the allowed ones with the same
noise as an unmasked row: seeded rows stay batch-invariant.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from batchgen.sampling_params import SamplingParams
from batchgen.structured.bitmask import TokenBitmask, apply_token_bitmask

_MASK64 = (1 << 64) - 1
# Uniform draws worth a thread of their own (~1 ms of mt19937).
_NOISE_PER_THREAD = 1 << 18


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    # Per row: {sampled id: logprob, then the top-k ids: logprob} when params.logprobs is not None.
    logprobs: list[dict[int, float] | None]


def step_seed(seed: int, step: int) -> int:
    """64-bit generator seed for a request's ``step``-th token: splitmix64 over (seed, step).

    Plain integer arithmetic, so it is the same in every process and on every platform.
    """
    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)
    return mix((int(seed) & _MASK64) ^ mix(int(step) & _MASK64))


def exponential_noise(seeds: Sequence[int], steps: Sequence[int], vocab_size: int) -> torch.Tensor:
    """q: [R, V] float32 on CPU; row r ~ Exponential(1), seeded step_seed(seeds[r], steps[r]).

    Inverse CDF of float64 uniforms: a float32 uniform is 0 with odds 2**-24 per token, and
    q = 0 would hand that token the race (about 1% of rows at V = 150k); float64 makes it 2**-53.
    Rows are filled on a few threads when the work is large (torch.rand releases the GIL).
    """
    R = len(seeds)
    u = torch.empty(R, vocab_size, dtype=torch.float64)
    row_seeds = [step_seed(s, t) for s, t in zip(seeds, steps)]

    def fill(rows: range) -> None:
        gen = torch.Generator(device="cpu")
        for r in rows:
            gen.manual_seed(row_seeds[r])
            torch.rand(vocab_size, generator=gen, dtype=torch.float64, out=u[r])

    n = min(R, torch.get_num_threads(), R * vocab_size // _NOISE_PER_THREAD)
    if n > 1:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(fill, [range(i, R, n) for i in range(n)]))
    else:
        fill(range(R))
    q = u.neg_().log1p_().neg_().to(torch.float32)
    # u = 0 would give q = 0 and 0/0 = nan for a masked token; argmax picks nan.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


def sample(logits: torch.Tensor,
           params: Sequence[SamplingParams],
           seeds: Sequence[int],
           steps: Sequence[int],
           prompt_ids: Sequence[Sequence[int]],
           output_ids: Sequence[Sequence[int]],
           eos_token_ids: Sequence[int],
           token_bitmask: TokenBitmask | None = None) -> SampleResult:
    """Choose one token per row. ``logits``: [B, V] raw model logits, any float dtype, any device.

    ``seeds`` holds each row's effective seed (the engine draws one when params.seed is None and
    keeps it with the request); ``steps`` the number of tokens the row generated so far.
    ``token_bitmask``: the structured-output rows' allowed tokens; those rows of ``logits`` are
    masked in place (and their logprobs are of the masked distribution, as in vLLM).
    """
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask)
    B, V = logits.shape
    dev = logits.device
    min_tok_rows = [i for i, p in enumerate(params) if steps[i] < p.min_tokens]
    if not min_tok_rows and all(p.is_greedy and not p.has_penalties for p in params):
        tokens = logits.argmax(dim=-1)
        return SampleResult(tokens.tolist(), _logprobs(logits, tokens, params))

    x = logits.to(torch.float32, copy=True)                       # [B, V], edited in place
    if min_tok_rows:
        _mask_stop_ids(x, min_tok_rows, params, eos_token_ids)
    pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
    if pen_rows:
        rows_t = torch.tensor(pen_rows, device=dev)
        x[rows_t] = apply_penalties(
            x[rows_t], [params[i].repetition_penalty for i in pen_rows],
            [params[i].presence_penalty for i in pen_rows],
            [params[i].frequency_penalty for i in pen_rows],
            [prompt_ids[i] for i in pen_rows], [output_ids[i] for i in pen_rows])

    tokens = torch.empty(B, dtype=torch.long, device=dev)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    rand = [i for i, p in enumerate(params) if not p.is_greedy]
    if greedy:
        g = torch.tensor(greedy, device=dev)
        tokens[g] = x[g].argmax(dim=-1)
    if rand:
        r = torch.tensor(rand, device=dev)
        tokens[r] = _sample_random(x[r], [params[i] for i in rand],
                                   [seeds[i] for i in rand], [steps[i] for i in rand])
    return SampleResult(tokens.tolist(), _logprobs(logits, tokens, params))


def _sample_random(x: torch.Tensor, params: Sequence[SamplingParams],
                   seeds: Sequence[int], steps: Sequence[int]) -> torch.Tensor:
    """x: [R, V] penalised logits of the non-greedy rows -> [R] sampled ids."""
    V = x.shape[1]
    x = x / _col([p.temperature for p in params], x)
    if any(p.min_p > 0 for p in params):
        x = apply_min_p(x, [p.min_p for p in params])
    x = apply_top_k_top_p(x, [p.top_k for p in params], [p.top_p for p in params])
    probs = x.softmax(dim=-1)
    q = exponential_noise(seeds, steps, V).to(x.device, non_blocking=True)
    return (probs / q).argmax(dim=-1)


def apply_penalties(x: torch.Tensor, repetition: Sequence[float], presence: Sequence[float],
                    frequency: Sequence[float], prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """vLLM's penalties, one value per row. x: [R, V] logits -> new [R, V].

    repetition_penalty covers prompt and output tokens: positive logits are divided by it,
    others multiplied. frequency (times the count) and presence (once) cover output tokens only.
    Ids outside [0, V) (padding) are ignored.
    """
    R, V = x.shape
    counts = torch.zeros(R, V, dtype=x.dtype, device=x.device)        # output-token counts
    rows, cols = _flatten(output_ids, V, x.device)
    counts.index_put_((rows, cols), torch.ones_like(cols, dtype=x.dtype), accumulate=True)
    in_output = counts > 0
    if any(r != 1.0 for r in repetition):
        seen = in_output.clone()
        rows, cols = _flatten(prompt_ids, V, x.device)
        seen[rows, cols] = True
        pen = torch.where(seen, _col(repetition, x), 1.0)
        x = torch.where(x > 0, x / pen, x * pen)
    return x - _col(frequency, x) * counts - _col(presence, x) * in_output


def apply_min_p(x: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """x: [R, V] logits. Drop tokens whose probability is below min_p * the top one's."""
    probs = x.softmax(dim=-1)
    cut = probs.amax(dim=-1, keepdim=True) * _col(min_p, x)
    return x.masked_fill(probs < cut, float("-inf"))


def apply_top_k_top_p(x: torch.Tensor, top_k: Sequence[int],
                      top_p: Sequence[float]) -> torch.Tensor:
    """x: [R, V] logits; per row top_k (0, -1 or >= V: off) and top_p (1: off). As vLLM.

    top_k keeps every token tied with the k-th largest. top_p keeps the smallest set of most likely
    tokens (after top_k) whose mass reaches p, and always the most likely one; a stable sort makes
    ties at the boundary resolve the same way on every run (the lower id is dropped first).
    """
    R, V = x.shape
    ks = [int(k) if 0 < k < V else V for k in top_k]
    use_k = any(k < V for k in ks)
    if not any(p < 1.0 for p in top_p):
        if not use_k:
            return x
        # Rows without top_k take k = 1 and then a -inf threshold, so topk stays small.
        on = torch.tensor([k < V for k in ks], device=x.device).unsqueeze(1)
        ks = [k if k < V else 1 for k in ks]
        k = torch.tensor(ks, device=x.device)
        kth = x.topk(max(ks), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        return x.masked_fill(on & (x < kth), float("-inf"))
    srt, idx = x.sort(dim=-1, stable=True)                             # ascending
    if use_k:
        k = torch.tensor(ks, device=x.device)
        kth = srt.gather(1, (V - k).unsqueeze(1))
        srt = srt.masked_fill(srt < kth, float("-inf"))
    cum = srt.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - _col(top_p, x)
    drop[:, -1] = False
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, idx, srt)


def _col(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row scalars as an [R, 1] column on like's device and dtype, to broadcast over V."""
    return torch.tensor([float(v) for v in values], dtype=like.dtype,
                        device=like.device).unsqueeze(1)


def _mask_stop_ids(x: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                   eos_token_ids: Sequence[int]) -> None:
    """Rows still under min_tokens may not end: their stop_token_ids and (unless ignore_eos, as
    vLLM) the eos ids get -inf."""
    V = x.shape[1]
    r_idx: list[int] = []
    c_idx: list[int] = []
    for i in rows:
        p = params[i]
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stop_ids.update(eos_token_ids)
        cols = sorted(t for t in stop_ids if 0 <= t < V)
        r_idx += [i] * len(cols)
        c_idx += cols
    if c_idx:
        x[torch.tensor(r_idx, device=x.device), torch.tensor(c_idx, device=x.device)] = float("-inf")


def _flatten(seqs: Sequence[Sequence[int]], V: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged id lists -> (row index, id), both [N] long, keeping only ids in [0, V)."""
    ids = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(s) for s in seqs]))
    keep = (ids >= 0) & (ids < V)
    return rows[keep].to(device), ids[keep].to(device)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
              params: Sequence[SamplingParams]) -> list[dict[int, float] | None]:
    """Logprobs from the raw logits (vLLM's default): sampled id first, then the top-k ids.

    logits: [B, V] as the model gave them; tokens: [B] the chosen ids.
    """
    out: list[dict[int, float] | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    r = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[r].float(), dim=-1)                  # [L, V]
    chosen = tokens[r]
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    max_k = min(max(int(params[i].logprobs) for i in rows), lp.shape[1])
    top_v, top_i = lp.topk(max_k, dim=-1)                               # [L, max_k]
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, (i, t) in enumerate(zip(rows, chosen.tolist())):
        k = int(params[i].logprobs)
        d = {t: chosen_lp[j]}
        for tid, v in zip(top_i[j][:k], top_v[j][:k]):
            if v != float("-inf"):  # a grammar-masked token: not a candidate (and not JSON)
                d.setdefault(tid, v)
        out[i] = d
    return out
