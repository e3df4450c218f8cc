"""Simulated fleet benchmarks (every figure here is simulated, not measured on GPUs).

(1) 128 simulated H200s, 100k rows of the reasoning workload on a Qwen3-30B-A3B-shaped model:
    BCT of static partitioning, dynamic batches and batchgen, the ideal bound, and the ratios
    the targets name (static / batchgen >= 2.3, batchgen / ideal <= 1.05). Run for the rows in
    random order and sorted by output length (long rows last: the order that makes static
    partitioning leave most GPUs idle).
    The mixed workload (a file of reasoning, chat and classification sources, README's workload
    statement) in random order and grouped by source: --workload mixed --orders random,grouped.
(3) --oracle: how near the ideal bound a policy that knew every row's length could come, in the
    fluid model of batchgen/sim/oblivious.py (longest first; the long rows on workers of their own).
    --age: what a policy that sees only each running row's age could buy by moving old rows to
    workers of their own (batchgen/sim/age_isolation.py, the same fluid model), over a grid.
(2) How long `batchgen plan --rows 1000000 --workers 128 --json` takes on this machine (every
    policy; target: < 2 minutes); it prints the load average around the run, as other jobs share
    the cores.

    python benchmarks/bench_sim.py                    # (1), both orders, ~5-10 min on 2 cores
    python benchmarks/bench_sim.py --workload mixed --orders random,grouped
    python benchmarks/bench_sim.py --million          # (2): every policy on 1M rows (--rows N: N rows)
    python benchmarks/bench_sim.py --rows 20000 --workers 32 --orders random   # quicker
    python benchmarks/bench_sim.py --oracle --workload mixed --orders random    # (3), ~5 min at 100k rows
    python benchmarks/bench_sim.py --age --orders random                        # (3), ~2 min at 100k rows
"""
from __future__ import annotations

import argparse
import os
import resource
import time

from batchgen.sim.age_isolation import age_isolated_bct
from batchgen.sim.cluster import ClusterSimConfig
from batchgen.sim.cost import build_cost
from batchgen.sim.engine_config import EngineSimConfig
from batchgen.sim.oblivious import (
    isolated_bct,
    length_aware_bct,
    oblivious_bct,
    start_orders,
    tail_bound,
    tail_need,
)
from batchgen.sim.planner import format_report, ideal_bound, run_plan
from batchgen.sim.policies import POLICIES
from batchgen.sim.profiles import load_profile
from batchgen.sim.shapes import load_shape
from batchgen.sim.workload import synthetic


def fleet(rows: int, workers: int, profile: str, model: str, order: str, workload: str,
          policies: tuple[str, ...] = ("static", "dynamic", "batchgen")) -> None:
    cost = build_cost(load_profile(profile), load_shape(model))
    w = synthetic(workload, rows, seed=0, order=order)  # type: ignore[arg-type]
    t0, cpu0 = time.perf_counter(), time.process_time()
    chosen = tuple(POLICIES[name] for name in policies)
    report = run_plan(w, cost, EngineSimConfig(), ClusterSimConfig(workers, processes=os.cpu_count() or 1), chosen)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    fifo = oblivious_bct(w, cost, EngineSimConfig(), workers)
    print(format_report(report, f"{rows} rows ({workload}, {order} order), {workers} x {model} on {profile}"))
    b, s = report.by_name("batchgen").bct_s, report.by_name("static").bct_s
    ideal = report.ideal.bct_s
    print(f"length-oblivious estimate (batchgen/sim/oblivious.py) {fifo / 60:.1f} min = {fifo / ideal:.3f} x ideal; "
          f"static / ideal {s / ideal:.2f} caps static / batchgen for any policy")
    print(f"targets: static / batchgen {s / b:.2f} (>= 2.3), batchgen / ideal {b / ideal:.3f} (<= 1.05), "
          f"batchgen / oblivious estimate {b / fifo:.3f}; simulated in {wall:.0f} s wall on {os.cpu_count() or 1} "
          f"processes ({cpu:.0f} s CPU in this one) "
          f"({', '.join(f'{r.policy} {r.wall_s:.0f} s' for r in report.results)})\n")


def million(rows: int, workers: int, profile: str, model: str, workload: str) -> None:
    """`batchgen plan --rows N --workers W --json`'s work (every policy, the ideal bound), timed:
    wall, CPU of this process and of the simulating ones, load average around the run."""
    cost = build_cost(load_profile(profile), load_shape(model))
    load0 = os.getloadavg()[0]
    t0, cpu0 = time.perf_counter(), time.process_time()
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w = synthetic(workload, rows, seed=0)
    # every core of this machine (batchgen/sim/parallel.py: the same results as one process)
    processes = os.cpu_count() or 1
    report = run_plan(w, cost, EngineSimConfig(), ClusterSimConfig(workers, processes=processes))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    kids = kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime
    bcts = ", ".join(f"{r.policy} {r.bct_s:.1f} s" for r in report.results)
    print(f"{rows} rows ({workload}) on {workers} x {model} on {profile}: simulated BCT {bcts} (ideal "
          f"{report.ideal.bct_s:.1f} s), batchgen moved {report.by_name('batchgen').migrated_coroutines} coroutines; "
          f"simulating took {wall:.0f} s wall on {processes} processes, CPU {cpu:.0f} s in this one and "
          f"{kids:.0f} s in the others; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; peak "
          f"memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB in this one")


def oracle(rows: int, workers: int, profile: str, model: str, workload: str, order: str) -> None:
    """How close knowing every row's length would come to the ideal bound (fluid estimates of
    batchgen/sim/oblivious.py: free, perfect migration; no policy here knows lengths)."""
    cost = build_cost(load_profile(profile), load_shape(model))
    w = synthetic(workload, rows, seed=0, order=order)  # type: ignore[arg-type]
    engine = EngineSimConfig()
    ideal = ideal_bound(w, cost, engine, workers)
    blind = oblivious_bct(w, cost, engine, workers)
    aware = length_aware_bct(w, cost, engine, workers)
    cap = int(w.output_len.max())
    best = min((isolated_bct(w, cost, engine, workers, int(cap * f), k), f, k)
               for f in (0.125, 0.25, 0.5, 0.75, 1.0)
               for k in sorted({max(1, workers * j // 16) for j in (1, 2, 4, 6, 8, 10, 12)} - {workers}))
    n_long = int((w.output_len >= int(cap * best[1])).sum())
    print(f"{rows} rows ({workload}, {order} order), {workers} x {model} on {profile} [simulated, fluid estimates]: "
          f"ideal bound {ideal.bct_s:.0f} s (work / workers {ideal.work_s:.0f} s, longest row alone "
          f"{ideal.longest_row_s:.0f} s); length-blind {blind / ideal.bct_s:.3f} x ideal; longest first "
          f"(lengths known) {aware / ideal.bct_s:.3f} x; best isolation of the long rows "
          f"{best[0] / ideal.bct_s:.3f} x (the {n_long} rows of >= {int(cap * best[1])} tokens on {best[2]} workers "
          f"of their own, longest first in both pools)")
    need = tail_need(w, cost, engine, workers, 1.05 * ideal.bct_s)
    bound = tail_bound(w, cost, engine, workers, 10 * ideal.bct_s)
    print(f"  to end within 5% of the ideal bound ({1.05 * ideal.bct_s:.0f} s), each of the {need.rows} rows of "
          f"{need.length} tokens must average <= {need.max_step_s * 1e3:.2f} ms a step; the job then takes >= "
          f"{need.gpu_seconds:,.0f} GPU-seconds, the fleet has {need.fleet_seconds:,.0f}: "
          f"{'not ruled out' if need.feasible else 'no schedule can'} (oblivious.tail_need). No schedule ends before "
          f"{bound:.0f} s = {bound / ideal.bct_s:.3f} x the ideal bound (oblivious.tail_bound)")


def age_isolation(rows: int, workers: int, profile: str, model: str, workload: str, order: str) -> None:
    """Rows that reach min_age tokens moved to `isolated` workers of their own (at most max_batch a
    worker, within their KV), both start orders the policies use; the best setting of the grid."""
    cost = build_cost(load_profile(profile), load_shape(model))
    w = synthetic(workload, rows, seed=0, order=order)  # type: ignore[arg-type]
    engine = EngineSimConfig()
    ideal = ideal_bound(w, cost, engine, workers).bct_s
    blind = oblivious_bct(w, cost, engine, workers)
    results = []
    for min_age in (4096, 16384):
        for max_batch in (2, 4, 8):
            for isolated in sorted({max(1, workers // 32), max(1, workers // 16)}):
                bct = min(age_isolated_bct(w, cost, engine, workers, min_age, isolated, max_batch, start)
                          for start in start_orders(rows, workers))
                results.append((bct, min_age, max_batch, isolated))
                print(f"  min_age {min_age}, max_batch {max_batch}, {isolated} isolated workers: "
                      f"{bct / ideal:.3f} x ideal", flush=True)
    best = min(results)
    print(f"{rows} rows ({workload}, {order} order), {workers} x {model} on {profile} [simulated, fluid estimates]: "
          f"length-blind {blind / ideal:.3f} x ideal; best age-based isolation {best[0] / ideal:.3f} x (min_age "
          f"{best[1]}, max_batch {best[2]}, {best[3]} isolated workers)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="rows (default: 100,000; with --million: 1,000,000)")
    ap.add_argument("--workers", type=int, default=128)
    ap.add_argument("--profile", default="H200")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--workload", default="reasoning")
    ap.add_argument("--orders", default="random,sorted")
    ap.add_argument("--policies", default="static,dynamic,batchgen", help="which to simulate, of static, dynamic, "
                    "batchgen, length-aware (static and "
                    "batchgen are the ratios the targets name)")
    ap.add_argument("--million", action="store_true", help="time plan's work on 1M rows (every policy) instead")
    ap.add_argument("--oracle", action="store_true", help="instead: how near the ideal bound knowing every "
                    "row's length would come (fluid estimates: longest first; long rows on workers of their own)")
    ap.add_argument("--age", action="store_true", help="instead: what moving rows that have grown long to "
                    "workers of their own could buy (fluid estimates, batchgen/sim/age_isolation.py)")
    args = ap.parse_args()
    if args.rows is not None and args.rows < 1 or args.workers < 1:
        ap.error(f"--rows and --workers must be >= 1, got {args.rows} and {args.workers}")
    if args.million:  # --rows is honoured: the default is the 1M rows the target names
        million(args.rows or 1_000_000, args.workers, args.profile, args.model, args.workload)
        return
    if args.age:
        for order in args.orders.split(","):
            age_isolation(args.rows or 100_000, args.workers, args.profile, args.model, args.workload, order)
        return
    if args.oracle:
        for order in args.orders.split(","):
            oracle(args.rows or 100_000, args.workers, args.profile, args.model, args.workload, order)
        return
    for order in args.orders.split(","):
        fleet(args.rows or 100_000, args.workers, args.profile, args.model, order, args.workload,
              tuple(args.policies.split(",")))


if __name__ == "__main__":
    main()
