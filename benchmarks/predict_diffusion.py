"""What the diffusion cost model predicts for a video job on a node of GPUs (default: 8 H200s,
Wan 2.1 T2V 1.3B): batchgen's elastic plan against one request at a time per GPU group.

No GPU is used. The cost model (batchgen.policy.diffusion_cost.CostModel) is built from the
model's shape and the GPU's figures instead of being calibrated on the workers:

  per_token       the transformer's matmul FLOPs per image token and forward (self-attention
                  q/k/v/o, cross-attention q/o and scores over the text rows, feed-forward) at
                  --gemm-efficiency of the GPU's dense bf16 peak;
  per_attn        self-attention's score and value FLOPs (4 x width per token per key, every
                  layer) at --attention-efficiency of that peak;
  per_comm_token  Ulysses' four all-to-alls per layer (q, k, v, output; bf16) over --link-gbps
                  per GPU, at degree 2 (the cost model's form charges every degree that, so
                  degrees above 2 are priced too high: the prediction is conservative for them);
  comm_fixed      the latency of those all-to-alls (--collective-latency-us each);
  fixed           per-forward overhead that does not grow with the batch (--layer-overhead-us per
                  layer: kernel launches, Python).

The job has the shape of `bench_diffusion.py --family wan` (its request generator: 9-81 frames
with a long tail, 40% large, 10-50 steps, CFG on half) at real resolutions (--large / --small,
HxW px) and --requests-per-gpu x --gpus requests, all submitted at t = 0.

  static    one request at a time per group of d GPUs (8 / d groups; requests dealt
            round-robin in arrival order), every degree the heads allow; the best of them is
            the baseline.
  batchgen  the elastic planner (policy.diffusion_plan.plan_round) in lockstep rounds: every
            round admits, places and spreads trajectories, each running one advances a step,
            and the round takes its most loaded GPU's modelled time. The real runtime lets
            degree-1 workers run free between rounds, so lockstep is its pessimistic case.

Not modelled (the same work per request in both systems, so they would only dilute the ratio):
prompt encoding, VAE decode, moving a trajectory's latents between GPUs.

    python benchmarks/predict_diffusion.py                       # 8 H200s, Wan 2.1 1.3B
    python benchmarks/predict_diffusion.py --model wan-14b --large 720x1280 --small 480x832
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgen.policy.diffusion_cost import CostModel  # noqa: E402
from batchgen.policy.diffusion_plan import ClusterState, ElasticOptions, Placed, plan_round  # noqa: E402
from batchgen.policy.diffusion_step import TrajView  # noqa: E402


@dataclass(frozen=True)
class DiT:
    """The transformer's shape (Wan 2.1's config: dim, ffn_dim, num_heads, num_layers, text_len)."""

    width: int
    ffn: int
    heads: int
    layers: int
    text_tokens: int = 512


MODELS = {"wan-1.3b": DiT(1536, 8960, 12, 30), "wan-14b": DiT(5120, 13824, 40, 40)}
H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's H200 SXM datasheet, dense (no sparsity)


def cost_model(m: DiT, args: argparse.Namespace) -> CostModel:
    peak = args.tflops * 1e12
    token_flops = m.layers * (12 * m.width ** 2 + 4 * m.width * m.ffn + 4 * m.width * m.text_tokens)
    attn_flops = m.layers * 4 * m.width
    bytes_per_token = 4 * m.layers * m.width * 2  # four bf16 all-to-alls per layer
    degree = 2  # a GPU sends (d - 1) / d of its T / d tokens; the form's (d - 1) / d x T matches d = 2 at T / 2
    return CostModel(fixed=m.layers * args.layer_overhead_us * 1e-6,
                     per_token=token_flops / (peak * args.gemm_efficiency),
                     per_attn=attn_flops / (peak * args.attention_efficiency),
                     per_comm_token=bytes_per_token / degree / (args.link_gbps * 1e9),
                     comm_fixed=4 * m.layers * args.collective_latency_us * 1e-6,
                     packed=True, source=f"analytic: {args.gpu_name}, {args.model}")


def job(n: int, seed: int, large: tuple[int, int], small: tuple[int, int]) -> list[TrajView]:
    """bench_diffusion.make_job's draw (same generator, same order of draws) at these sizes."""
    rng = random.Random(seed)
    views = []
    for i in range(n):
        h, w = large if rng.random() < 0.4 else small
        rng.choice(range(4))  # the bench's prompt draw, kept so the frames and steps match its job
        frames = 4 * min(20, int(rng.paretovariate(1.2)) + 1) + 1
        steps = rng.randint(10, 50)
        rows = 2 if rng.choice([1.0, 4.0]) > 1 else 1
        latent = ((frames - 1) // 4 + 1, h // 8, w // 8)
        tokens = latent[0] * (h // 16) * (w // 16)
        views.append(TrajView(i, (latent,), tokens, rows, steps, 0.0))
    rng.shuffle(views)
    return [replace(v, tid=i) for i, v in enumerate(views)]


def static(views: list[TrajView], gpus: int, degree: int, cost: CostModel) -> tuple[float, list[float]]:
    """One request at a time per group of `degree` GPUs, dealt round-robin -> makespan, latencies."""
    ends = [0.0] * (gpus // degree)
    latency = []
    for i, v in enumerate(views):
        g = i % len(ends)
        ends[g] += v.remaining * cost.step_time(v.rows * v.tokens, v.tokens, degree)
        latency.append(ends[g])
    return max(ends), latency


def elastic(views: list[TrajView], gpus: int, degrees: tuple[int, ...], cost: CostModel, policy: str,
            options: ElasticOptions) -> tuple[float, list[float], dict[int, int]]:
    """The planner's lockstep rounds -> makespan, latencies, steps run at each degree."""
    ranks = tuple(range(gpus))
    waiting = {v.tid: v for v in views}
    running: dict[int, Placed] = {}
    now, latency, at_degree = 0.0, {}, {}
    while waiting or running:
        plan = plan_round(ClusterState(ranks, tuple(running.values()), tuple(waiting.values()), now, degrees),
                          policy, cost, options)
        for tids in plan.admit.values():
            for tid in tids:
                running[tid] = Placed(waiting.pop(tid), (0,))
        now += plan.est_round_s
        for tid, group in plan.groups.items():
            v = running[tid].view
            at_degree[len(group)] = at_degree.get(len(group), 0) + 1
            if v.remaining == 1:
                latency[tid] = now
                del running[tid]
            else:
                running[tid] = Placed(replace(v, remaining=v.remaining - 1), group)
    return now, [latency[v.tid] for v in views], at_degree


def size(text: str) -> tuple[int, int]:
    h, w = (int(x) for x in text.lower().split("x"))
    if h % 16 or w % 16:
        raise argparse.ArgumentTypeError(f"{text}: height and width must be multiples of 16 (VAE 8 x patch 2)")
    return h, w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wan-1.3b", choices=sorted(MODELS))
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--requests-per-gpu", type=int, default=12, help="bench_diffusion --family wan: 24 on 2 workers")
    ap.add_argument("--large", type=size, default=(480, 832), help="HxW px of the large videos")
    ap.add_argument("--small", type=size, default=(240, 416), help="HxW px of the small videos")
    ap.add_argument("--seeds", type=int, default=5, help="jobs drawn (seeds 0..n-1); the median ratio is reported")
    ap.add_argument("--policy", default="srwf", choices=("fcfs", "srwf", "deadline"))
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--gpu-name", default="H200")
    ap.add_argument("--tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="dense bf16 peak per GPU")
    ap.add_argument("--gemm-efficiency", type=float, default=0.6)
    ap.add_argument("--attention-efficiency", type=float, default=0.5)
    ap.add_argument("--link-gbps", type=float, default=450.0, help="all-to-all bandwidth per GPU, GB/s (NVLink)")
    ap.add_argument("--collective-latency-us", type=float, default=25.0)
    ap.add_argument("--layer-overhead-us", type=float, default=200.0)
    args = ap.parse_args()

    m = MODELS[args.model]
    cost = cost_model(m, args)
    degrees = tuple(d for d in range(1, args.gpus + 1) if m.heads % d == 0)
    options = ElasticOptions(max_running=args.max_running)
    print(f"{args.gpus} x {args.gpu_name}, {args.model}; {cost}")
    for hw in (args.small, args.large):
        for frames in (9, 81):
            tokens = ((frames - 1) // 4 + 1) * (hw[0] // 16) * (hw[1] // 16)
            times = ", ".join(f"d{d} {cost.step_time(2 * tokens, tokens, d) * 1e3:.0f} ms" for d in degrees)
            print(f"  {hw[0]}x{hw[1]} px, {frames} frames ({tokens} tokens), one CFG step: {times}")
    ratios, against_d1 = [], []
    for seed in range(args.seeds):
        views = job(args.gpus * args.requests_per_gpu, seed, args.large, args.small)
        statics = {d: static(views, args.gpus, d, cost) for d in degrees if args.gpus % d == 0}
        best_d = min(statics, key=lambda d: statics[d][0])
        s_span, s_lat = statics[best_d]
        b_span, b_lat, at_degree = elastic(views, args.gpus, degrees, cost, args.policy, options)
        ratios.append(s_span / b_span)
        against_d1.append(statics[1][0] / b_span)
        spans = ", ".join(f"d{d} {span:.0f} s" for d, (span, _) in statics.items())
        print(f"seed {seed}: static one at a time ({spans}; best d{best_d}) / batchgen {b_span:.0f} s = "
              f"{s_span / b_span:.2f}x makespan; mean latency {statistics.mean(b_lat):.0f} s against "
              f"{statistics.mean(s_lat):.0f} s ({statistics.mean(b_lat) / statistics.mean(s_lat) - 1:+.0%}); "
              f"trajectory-steps at each degree {dict(sorted(at_degree.items()))}")
    print(f"median static / batchgen over {args.seeds} jobs: {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}); against static at degree 1 "
          f"{statistics.median(against_d1):.2f}x (range {min(against_d1):.2f}-{max(against_d1):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
