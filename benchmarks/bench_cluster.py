"""Skewed batch job on a 2-worker LocalCluster: batchgen against what a Dask user writes today.

Rows are sorted by output length, so the last partitions hold the longest rows and whichever
worker gets them becomes the tail. Compared, all with warm models, all greedy, exact lengths
(ignore_eos, per-row max_tokens):

  hf        map_partitions + a transformers model cached per worker, `generate` on fixed chunks
            of rows with left padding (each chunk runs to its longest row)
  static    batchgen, one engine per worker combining its partitions, no split / migration
  batchgen  batchgen with split and migration
  ideal     one engine over all rows, in one worker, divided by the number of workers
  balanced  every worker runs one engine over an equal share of the rows (every n-th row by
            length), all at once: the best any placement can do on this machine. On a shared
            or oversubscribed machine it is far above `ideal`: workers that run side by side
            each go slower than one alone, and balancing cannot win that back.

Prints completion-time ratios (the headline) and, below them, the seconds they come from.

The default job has 1024 rows, more than one engine holds at once (max_num_seqs 256), as any real
batch job does. Far smaller jobs measure something else: each worker's batch stays too small to
amortize reading the expert weights every step, so two half-size batches cost more than one
full one and `ideal` (a perfectly divisible job) is out of reach for any placement (with 256
rows: balanced / ideal 1.2-1.35 on this machine).

    python benchmarks/bench_cluster.py                  # demo model, ~5 minutes on 2 cores
    python benchmarks/bench_cluster.py --partitions 4   # the same rows in 4 partitions
    python benchmarks/bench_cluster.py --rows 64 --max-tokens 64 --skip-hf   # quick smoke run
    python benchmarks/bench_cluster.py --rows 256 --pairs 3 --orders   # (a) alone: 3 alternated pairs,
                                        # wall and CPU ratios, each run's wall-time breakdown and orders
    python benchmarks/bench_cluster.py --admission-pairs 2 --skip-hf   # batchgen with today's admission
                                        # order against length-aware admission (admission_order="length"),
                                        # alternated; --prompt-signal: prompt lengths follow output lengths
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
from distributed import Client, LocalCluster, get_worker

import batchgen.cluster as bc
from batchgen.policy.balance import BalanceConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))  # the checkpoint builders


def make_rows(n: int, vocab: int, min_tokens: int, max_tokens: int, seed: int,
              lengths: str = "uniform", prompt_signal: bool = False) -> pd.DataFrame:
    """Rows sorted by output length. uniform: min..max tokens; lognormal: bench_engine's model of
    output lengths (median ~27, a few rows ~10x that), clipped to min..max. prompt_signal: a row's
    prompt length is in a power-of-two bucket set by its output length (as rows made from one
    template share both), so a length predictor keyed by prompt bucket can learn; else prompts are
    8-32 tokens whatever the output."""
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(5, vocab) for _ in range(rng.randint(8, 32))] for _ in range(n)]
    draw = (lambda: rng.randint(min_tokens, max_tokens)) if lengths == "uniform" else \
        (lambda: max(min_tokens, min(max_tokens, int(rng.lognormvariate(3.3, 0.9)))))
    lengths = sorted(draw() for _ in range(n))  # skew: long rows last
    if prompt_signal:  # quartiles of output length -> prompts of 4-7, 8-15, 16-31, 32-63 tokens
        prompts = [p[:1] + [rng.randrange(5, vocab) for _ in range(rng.randint(2 ** (2 + 4 * i // n),
                                                                                2 ** (3 + 4 * i // n) - 2))]
                   for i, p in enumerate(prompts)]
    return pd.DataFrame({"prompt": pd.Series(prompts, dtype=pd.ArrowDtype(pa.list_(pa.int64()))),
                         "max_tokens": lengths})


# -- (a) what a Dask user writes today -----------------------------------------------------------
def hf_partition(pdf: pd.DataFrame, model: str, chunk: int, pad_id: int) -> pd.DataFrame:
    import torch
    from transformers import AutoModelForCausalLM

    worker = get_worker()
    hf = getattr(worker, "_bench_hf_model", None)
    if hf is None:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        worker._bench_hf_model = hf  # cached per worker
    counts: list[int] = []
    for start in range(0, len(pdf), chunk):
        part = pdf.iloc[start:start + chunk]
        prompts = [list(p) for p in part["prompt"]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = int(part["max_tokens"].max())
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=pad_id)
        counts += [min(int(m), out.shape[1] - width) for m in part["max_tokens"]]
    return pdf.assign(num_generated_tokens=counts)


# -- single engine (ideal bound) -----------------------------------------------------------------
def single_engine_seconds(pdf: pd.DataFrame, model: str, options: dict[str, Any]) -> float:
    from batchgen import Engine, SamplingParams

    engine = Engine(model, **options)
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True) for m in pdf["max_tokens"]]
    prompts = [list(p) for p in pdf["prompt"]]
    engine.generate(prompts[:2], params[:2])  # warm up
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - t0


def balanced_seconds(client: Client, pdf: pd.DataFrame, model: str, options: dict[str, Any]) -> float:
    names = sorted(client.scheduler_info()["workers"])
    shares = [pdf.iloc[i::len(names)] for i in range(len(names))]
    return max(client.gather([client.submit(single_engine_seconds, share, model, options, workers=[w], pure=False)
                              for w, share in zip(names, shares)]))


def run_batchgen(client: Client, ddf: dd.DataFrame, model: str, options: dict[str, Any],
                 costs: list[dict[str, float]] | None = None, prestart: bool = True) -> float:
    """-> completion seconds, from building the graph (map_partitions) to the result. costs: gets
    this run's fixed costs (see fixed_costs). prestart=False passes meta= so Dask makes no meta
    call, and the engines start only when tasks arrive (the code before prestart.py)."""
    t0 = time.perf_counter()
    wall0 = time.time()
    meta = {} if prestart else {"meta": bc.generate(ddf._meta, model=model, engine_options=options)}
    lazy = ddf.map_partitions(bc.generate, model=model, per_row={"max_tokens": "max_tokens"}, engine_options=options,
                              temperature=0.0, ignore_eos=True, **meta)
    compute_at = time.time()
    out = lazy.compute()
    seconds = time.perf_counter() - t0
    result_at = time.time()
    assert (out["num_generated_tokens"] == out["max_tokens"]).all(), "a row came back short"
    if costs is not None:
        costs.append(fixed_costs(client, wall0, compute_at, result_at))
    return seconds


def fixed_costs(client: Client, built_at: float, compute_at: float, result_at: float) -> dict[str, float]:
    """A job's fixed costs from the workers' timelines (batchgen.cluster.metrics), in seconds:
    first_token_max (compute() to the first token, on the slowest worker), task_start_max
    (compute() to a worker's first task), engine_load_max (engine loading inside the job),
    result_after_last_token (the last token on any worker to the result in the client)."""
    time.sleep(0.5)  # two load pushes: the workers' last timelines reach the plugin
    workers = bc.metrics(client)["workers"].values()
    lines = [w["timeline"] for w in workers if w.get("timeline") and w["timeline"]["period"]]
    periods = [t["period"] for t in lines if t["period"]["started"] >= built_at]
    if not periods:
        return {}
    loads = [p["engine_ready"] - p["engine_loading"] for p in periods if p["engine_ready"] and p["engine_loading"]]
    return {"first_token_max": max(p["first_token"] - compute_at for p in periods if p["first_token"]),
            "task_start_max": max(p["started"] - compute_at for p in periods),
            "engine_load_max": max(loads, default=0.0),
            "result_after_last_token": result_at - max(t["last_token"] for t in lines if t["last_token"]),
            "breakdown": breakdown(periods, built_at, compute_at, result_at)}


def breakdown(periods: list[dict[str, Any]], built_at: float, compute_at: float, result_at: float
              ) -> dict[str, float]:
    """Where the job's wall time went, in seconds: on the client (graph build, the tail from the
    last task's return to the result), and per worker (the slowest worker's figure, and the
    busiest's engine-thread time): task start, hand-off of the rows to the engine, the first
    forward, forwards, commands (rows, migration), balancer snapshots, idle with the job open,
    the last token to the task's return."""
    def worst(f: Any) -> float:
        values = [f(p) for p in periods]
        return max((v for v in values if v is not None), default=0.0)

    return {
        "build (map_partitions, meta call)": compute_at - built_at,
        "compute() -> first task starts": worst(lambda p: p["started"] - compute_at),
        "task start -> rows in engine": worst(lambda p: p["rows_queued"] and p["rows_queued"] - p["started"]),
        "rows in engine -> first token": worst(lambda p: p["first_token"] and p["rows_queued"]
                                               and p["first_token"] - p["rows_queued"]),
        "first step (prefill)": worst(lambda p: p["first_step_s"]),
        "steps (forwards)": worst(lambda p: p["step_s"]),
        "step count": worst(lambda p: p["steps"]),
        "engine commands (rows, migration)": worst(lambda p: p["command_s"]),
        "balancer snapshots": worst(lambda p: p["snapshot_s"]),
        "engine idle while the job is open": worst(lambda p: p["idle_s"]),
        "first token -> last token": worst(lambda p: p["last_token"] and p["first_token"]
                                           and p["last_token"] - p["first_token"]),
        "last token -> task returns": worst(lambda p: p["ended"] and p["last_token"] and p["ended"] - p["last_token"]),
        "last task returns -> result in client": result_at - worst(lambda p: p["ended"]),
        "compute() -> result": result_at - compute_at,
    }


def _plugin_log(dask_scheduler: Any) -> list[tuple[float, str, str, int, int, str]]:
    from batchgen.cluster.plugin import PLUGIN_NAME

    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    return [(t, o.src, o.dst, len(o.seq_ids), o.tokens, o.reason) for t, o in plugin.log] if plugin else []


def order_log(client: Client, since: float) -> list[str]:
    """The balancer's orders of the last run (the plugin keeps the last 100): 'at s: src -> dst, n rows, tokens'."""
    names = {w: f"w{i}" for i, w in enumerate(sorted(client.scheduler_info()["workers"]))}
    return [f"{t - since:6.2f}s {names.get(src, src)} -> {names.get(dst, dst)}: {n} rows, {tokens} tokens ({reason})"
            for t, src, dst, n, tokens, reason in client.run_on_scheduler(_plugin_log) if t >= since]


def cold_runs(client: Client, ddf: dd.DataFrame, model: str, options: dict[str, Any], repeat: int
              ) -> dict[str, dict[str, float]]:
    """Fixed costs with engines stopped before each run (`release`), with and without starting
    them at graph construction (prestart.py), alternated; the best of each kept."""
    best: dict[str, dict[str, float]] = {}
    for _ in range(repeat):
        for name, pre in (("cold, engines started at compute (tasks)", False), ("cold, prestarted at map_partitions", True)):
            bc.release(client)
            costs: list[dict[str, float]] = []
            seconds = run_batchgen(client, ddf, model, options, costs, prestart=pre)
            run = {**costs[0], "seconds": seconds} if costs else {"seconds": seconds}
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    return best


def print_costs(name: str, c: dict[str, float]) -> None:
    if not c:
        print(f"  {name:44} (no timeline)")
        return
    print(f"  {name:44} first token {c['first_token_max']:5.2f}s  task start {c['task_start_max']:5.2f}s  "
          f"engine load {c['engine_load_max']:5.2f}s  result after last token {c['result_after_last_token']:5.2f}s"
          + (f"  (job {c['seconds']:.1f}s)" if "seconds" in c else ""))
    for what, value in c.get("breakdown", {}).items():
        print(f"      {what:44} {value:7.2f}")


def warm_up(client: Client, model: str, options: dict[str, Any], vocab: int) -> None:
    rows = make_rows(2, vocab, 2, 2, seed=1)
    client.gather([client.submit(bc.generate, rows, model=model, per_row={"max_tokens": "max_tokens"},
                                 engine_options=options, workers=[w], pure=False)
                   for w in client.scheduler_info()["workers"]])


def hf_seconds(ddf: dd.DataFrame, pdf: pd.DataFrame, model: str, chunk: int, pad_id: int) -> float:
    t0 = time.perf_counter()
    ddf.map_partitions(hf_partition, model, chunk, pad_id, meta=pdf.iloc[:0].assign(num_generated_tokens=0)).compute()
    return time.perf_counter() - t0


def _cpu_seconds() -> float:
    return time.process_time()


def worker_cpu(client: Client) -> dict[str, float]:
    """CPU seconds each worker process has used so far (all its threads)."""
    return client.run(_cpu_seconds)


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> float:
    """The busiest worker's CPU seconds between two readings: on a machine with a core per worker
    and nothing else running, about its wall time (the job's, when it is the last to finish)."""
    return max(after[w] - before[w] for w in before if w in after)


def ratio_pairs(client: Client, ddf: dd.DataFrame, pdf: pd.DataFrame, model: str, options: dict[str, Any],
                vocab: int, chunk: int, pad_id: int, pairs: int, orders: bool = False, skip_hf: bool = False) -> None:
    """(a) alone, as alternated pairs (batchgen, then transformers, warm): each pair's ratio, the
    best and the median, with the load average at each pair; and each batchgen run's breakdown.
    Also the ratio of the busiest worker's CPU seconds (hf / batchgen): on a shared, oversubscribed
    machine wall time follows the share of the cores each side got, CPU time much less."""
    if not skip_hf:
        client.gather([client.submit(hf_partition, pdf.iloc[:1], model, chunk, pad_id, workers=[w], pure=False)
                       for w in client.scheduler_info()["workers"]])
    bc.connect(client=client, balance=BalanceConfig())
    warm_up(client, model, options, vocab)
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    for i in range(pairs):
        costs: list[dict[str, float]] = []
        load0 = os.getloadavg()[0]
        since = time.monotonic()
        c0 = worker_cpu(client)
        b = run_batchgen(client, ddf, model, options, costs)
        c1 = worker_cpu(client)
        moved = bc.metrics(client).get("migrations", 0)
        log = order_log(client, since) if orders else []
        if skip_hf:
            print(f"run {i}: batchgen {b:.2f}s, busiest worker's CPU {cpu_delta(c0, c1):.2f}s (load average "
                  f"{load0:.1f} -> {os.getloadavg()[0]:.1f}; migrated so far {moved})", flush=True)
            if costs:
                print_costs(f"batchgen run {i}", costs[0])
            for line in log:
                print("    " + line)
            continue
        h = hf_seconds(ddf, pdf, model, chunk, pad_id)
        c2 = worker_cpu(client)
        ratios.append(h / b)
        bcpu, hcpu = cpu_delta(c0, c1), cpu_delta(c1, c2)
        cpu_ratios.append(hcpu / bcpu)
        print(f"pair {i}: batchgen {b:.2f}s, hf {h:.2f}s, hf / batchgen {h / b:.2f}; busiest worker's CPU "
              f"batchgen {bcpu:.2f}s, hf {hcpu:.2f}s, hf / batchgen {hcpu / bcpu:.2f}  (load average "
              f"{load0:.1f} -> {os.getloadavg()[0]:.1f}; migrated so far {moved})", flush=True)
        if costs:
            print_costs(f"batchgen run of pair {i}", costs[0])
        for line in log:
            print("    " + line)
    if skip_hf:
        return
    for name, values in (("wall", ratios), ("busiest worker's CPU", cpu_ratios)):
        values.sort()
        print(f"hf / batchgen ({name}) over {pairs} pairs: best {values[-1]:.2f}, "
              f"median {values[len(values) // 2]:.2f}, worst {values[0]:.2f}")


def admission_pairs(client: Client, ddf: dd.DataFrame, model: str, options: dict[str, Any], vocab: int,
                    pairs: int) -> None:
    """Balancing on, alternated (ABBA, after an untimed job of each): today's admission order (the
    engine's default) and length-aware admission (admission_order="length"), each run's seconds
    and the load average around it."""
    bc.connect(client=client, balance=BalanceConfig())
    variants = {"today": options, "length-aware": {**options, "admission_order": "length"}}
    for opts in variants.values():
        warm_up(client, model, opts, vocab)
        run_batchgen(client, ddf, model, opts)  # untimed: a first full job still pays one-time costs
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(pairs):
        for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):  # ABBA: drift cancels
            opts = variants[name]
            load0 = os.getloadavg()[0]
            t = run_batchgen(client, ddf, model, opts)
            seconds[name].append(t)
            print(f"pair {i}: {name} {t:.2f}s (load average {load0:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    ratios = [b / a for a, b in zip(seconds["today"], seconds["length-aware"])]
    print("length-aware / today per pair: " + ", ".join(f"{r:.3f}" for r in ratios)
          + f"; best today {min(seconds['today']):.2f}s, best length-aware {min(seconds['length-aware']):.2f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build the demo model)")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--partitions", type=int, default=2, help="default: one per worker")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lengths", choices=["uniform", "lognormal"], default="uniform",
                    help="output length model (lognormal: as bench_engine, clipped to --min/--max-tokens)")
    ap.add_argument("--chunk", type=int, default=16, help="rows per transformers generate call")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="static / batchgen runs, alternated; best kept")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-cold", action="store_true", help="skip the fixed-cost runs with engines stopped first")
    ap.add_argument("--orders", action="store_true", help="print the balancer's orders of the best batchgen run")
    ap.add_argument("--pairs", type=int, default=0,
                    help="measure only (a): this many alternated batchgen / transformers pairs (best, median)")
    ap.add_argument("--admission-pairs", type=int, default=0, metavar="N",
                    help="measure only today's admission order against length-aware admission, N alternated pairs")
    ap.add_argument("--prompt-signal", action="store_true",
                    help="prompt lengths follow output lengths (a template signal a length predictor can learn)")
    args = ap.parse_args()

    from demo_builder import build_demo_model, tokenizer_vocab_size

    from batchgen.demo import PAD_ID

    model = args.model or str(build_demo_model(Path(tempfile.gettempdir()) / "batchgen-bench-demo", dtype="float32"))
    vocab = tokenizer_vocab_size(model)
    options: dict[str, Any] = {"dtype": "float32", "kv_cache_bytes": 256 << 20}
    pdf = make_rows(args.rows, vocab, args.min_tokens, args.max_tokens, seed=0, lengths=args.lengths,
                    prompt_signal=args.prompt_signal)
    tokens = int(pdf["max_tokens"].sum())
    cores = os.cpu_count() or 1
    env = {"OMP_NUM_THREADS": str(max(1, cores // args.workers))}
    print(f"{args.rows} rows in {args.partitions} partitions sorted by {args.lengths} length ({args.min_tokens}-{args.max_tokens} "
          f"tokens, {tokens} in all), {args.workers} workers x 1 thread, {env['OMP_NUM_THREADS']} torch thread(s) each",
          file=sys.stderr)

    seconds: dict[str, float] = {}
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env=env) as cluster, Client(cluster) as client:
        ddf = dd.from_pandas(pdf, npartitions=args.partitions, sort=False)
        if args.admission_pairs:
            admission_pairs(client, ddf, model, options, vocab, args.admission_pairs)
            bc.disconnect(client)
            return
        if args.pairs:
            ratio_pairs(client, ddf, pdf, model, options, vocab, args.chunk, PAD_ID, args.pairs, args.orders,
                        args.skip_hf)
            bc.disconnect(client)
            return
        first = sorted(client.scheduler_info()["workers"])[0]
        seconds["single"] = client.submit(single_engine_seconds, pdf, model, options, workers=[first]).result()
        moved: dict[str, Any] = {}
        orders: list[str] = []
        warm_costs: dict[str, float] = {}
        for _ in range(args.repeat):  # alternate, keep the best of each: the machine's load drifts
            seconds["balanced"] = min(seconds.get("balanced", float("inf")),
                                      balanced_seconds(client, pdf, model, options))
            bc.connect(client=client, balance=BalanceConfig(split=False, migrate=False))
            warm_up(client, model, options, vocab)
            seconds["static"] = min(seconds.get("static", float("inf")), run_batchgen(client, ddf, model, options))
            bc.connect(client=client, balance=BalanceConfig())  # re-registers: split and migration on
            warm_up(client, model, options, vocab)
            run_costs: list[dict[str, float]] = []
            since = time.monotonic()
            t = run_batchgen(client, ddf, model, options, run_costs)
            if t < seconds.get("batchgen", float("inf")):
                seconds["batchgen"], warm_costs = t, (run_costs[0] if run_costs else {})
                orders = order_log(client, since)
            moved = bc.metrics(client)
        cold = cold_runs(client, ddf, model, options, args.repeat) if not args.skip_cold else {}
        bc.disconnect(client)

        if not args.skip_hf:
            client.gather([client.submit(hf_partition, pdf.iloc[:1], model, args.chunk, PAD_ID, workers=[w], pure=False)
                           for w in client.scheduler_info()["workers"]])
            seconds["hf"] = hf_seconds(ddf, pdf, model, args.chunk, PAD_ID)

    ideal = seconds["single"] / args.workers
    b = seconds["batchgen"]
    print("\nbatch completion time ratios (lower is better for the left side):")
    print(f"  batchgen / ideal (single engine / {args.workers})  {b / ideal:6.2f}")
    print(f"  batchgen / balanced  (equal shares, measured)  {b / seconds['balanced']:6.2f}")
    print(f"  balanced / ideal     (machine's parallel loss)  {seconds['balanced'] / ideal:6.2f}")
    print(f"  static   / batchgen  (no split, no migration)  {seconds['static'] / b:6.2f}")
    if "hf" in seconds:
        print(f"  hf       / batchgen  (transformers, chunks of {args.chunk})  {seconds['hf'] / b:6.2f}")
    print(f"  migrated coroutines (last batchgen run): {moved.get('migrations', 0)}, "
          f"by reason {moved.get('by_reason', {})}")
    if args.orders:
        print("  balancer orders of the best batchgen run (seconds from map_partitions):")
        for line in orders:
            print("    " + line)
    print("fixed costs of a job (seconds from compute(); the slowest worker):")
    print_costs("warm (engines loaded, best batchgen run)", warm_costs)
    for name, c in cold.items():
        print_costs(name, c)
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + f", ideal {ideal:.1f}")


if __name__ == "__main__":
    main()
