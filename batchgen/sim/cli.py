"""``batchgen plan`` (simulate a job on a fleet) and ``batchgen bench --calibrate`` (fit a profile).

Parsers only here; the simulator is imported when a command runs. Bad input raises PlanError
(exit 2 from the CLI, with the message naming the option and the value).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..config import size_arg
from ..errors import PlanError

# From this many rows `plan` spreads the simulated fleet over every core (parallel.py): below,
# starting the processes costs about what they save.
PARALLEL_ROWS = 50_000

def parse_size(text: str) -> int:
    """'8GiB', '8G', '512MiB', '24GB', '1000000' -> bytes: ``batchgen run``'s parser (dask's units)."""
    return size_arg(text)


def _lengths_path(text: str) -> Path | str:
    """A local path, or a URL kept as text (``Path`` would fold its ``//``)."""
    return text if "://" in text and not text.startswith("file://") else Path(text.removeprefix("file://"))


def _local_lengths(source: Path | str, stack: contextlib.ExitStack) -> Path:
    """A --lengths URL copied into a temporary file (the simulator reads local files), kept
    for as long as ``stack`` is open."""
    if isinstance(source, Path):
        return source
    import shutil
    import tempfile

    from ..io.storage import locate, open_input

    loc = locate(source, flag="--lengths")
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchgen-lengths-")))
    name = loc.name.rsplit(".", 1)[0] if loc.name.lower().endswith((".gz", ".bz2", ".zst", ".xz")) else loc.name
    local = folder / name
    try:
        with open_input(loc.fs, loc.path, loc.url, "--lengths") as src, open(local, "wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
    except FileNotFoundError:
        raise PlanError(f"--lengths {source}: no such file") from None
    return local


def _worker_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected worker counts like 8,16,32, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected worker counts >= 1 like 8,16,32, got {text!r}")
    return values


POLICY_NAMES = ("static", "dynamic", "batchgen", "length-aware")  # sim/policies.POLICIES' keys


def _policy_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [n for n in names if n not in POLICY_NAMES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected policies of {', '.join(POLICY_NAMES)}, got {text!r}")
    return names


def add_commands(sub: Any) -> None:
    plan = sub.add_parser(
        "plan", help="simulate a batch job on a fleet: completion time per policy (simulated)",
        description="Simulate the job on --workers engines with the real scheduling and balancing "
        "code and a cost model from --profile; print the batch completion time (BCT), GPU-hours and "
        "utilization of static partitioning, dynamic batches and batchgen, and the ideal bound. "
        "Figures are simulated, not measured.")
    plan.add_argument("--rows", type=int, metavar="N", help="rows of the synthetic workload (with "
                      "--lengths: use the first N rows of the file)")
    plan.add_argument("--workers", type=int, metavar="W", help="engines (GPUs) in the fleet")
    plan.add_argument("--profile", required=True, metavar="P", help="H100, H200, A100-80G, A5000, L4, "
                      "or a profile JSON from `batchgen bench --calibrate`")
    plan.add_argument("--model", metavar="DIR", help="model directory (its config.json gives the shapes) or "
                      "qwen3-30b-a3b, deepseek-v3, mixtral-8x7b (default for GPU profiles: qwen3-30b-a3b)")
    plan.add_argument("--lengths", type=_lengths_path, metavar="FILE|URL", help="Parquet/CSV/JSONL (a path or an "
                      "fsspec URL: s3://, gs://, http(s)://, ...) with prompt_tokens and "
                      "output_tokens columns (optional max_tokens), or an OpenAI batch file (needs --model DIR)")
    plan.add_argument("--workload", default="reasoning",
                      choices=["reasoning", "summarization", "classification", "chat", "mixed", "mislead"],
                      help="synthetic length model (default: reasoning); mixed: reasoning, chat and "
                      "classification rows from one file, each naming its source; mislead: two sources whose "
                      "first finished rows mislead a length predictor")
    plan.add_argument("--policies", type=_policy_list, default=("static", "dynamic", "batchgen"), metavar="LIST",
                      help="policies to simulate, of static, dynamic, batchgen, length-aware (default: "
                      "static,dynamic,batchgen); length-aware: batchgen with the engines admitting the rows "
                      "predicted longest first (EngineConfig admission_order='length')")
    plan.add_argument("--order", default=None, choices=["random", "sorted", "grouped"],
                      help="row order of the synthetic workload (default random; a --lengths file keeps its "
                      "own order); sorted: longest outputs last; grouped: "
                      "a mixture's sources one after another (as concatenated files are)")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--expert-memory", type=parse_size, metavar="SIZE", help="device memory for routed "
                      "experts (e.g. 8GiB); the rest is fetched from host memory / disk per forward")
    plan.add_argument("--max-num-seqs", type=int, metavar="N", help="seats per engine (default: 256; with a "
                      "calibrated profile, the engine's it was measured with)")
    plan.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="tokens per forward (default: "
                      "8192; with a calibrated profile, the engine's it was measured with)")
    plan.add_argument("--sweep-workers", type=_worker_list, metavar="LIST",
                      help="also simulate these fleet sizes, e.g. 8,16,32,64,128")
    plan.add_argument("--png", type=Path, metavar="FILE", help="draw per-worker utilization over time (matplotlib)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.add_argument("--processes", type=int, metavar="N", help="simulate the fleet on N processes (the same "
                      "result; default: every core for jobs of 50k rows or more, else 1)")
    plan.set_defaults(handler=run_plan_command)

    bench = sub.add_parser("bench", help="measure this machine's engine and fit a profile for `plan`",
                           description="Time the real engine over a grid of batch sizes and context "
                           "lengths and fit the simulator's step-time model to it.")
    bench.add_argument("--calibrate", required=True, type=Path, metavar="MODEL_DIR", help="model to measure")
    bench.add_argument("-o", "--output", required=True, type=Path, metavar="FILE", help="profile JSON to write")
    bench.add_argument("--dtype", default="float32")
    bench.add_argument("--device", default=None)
    bench.add_argument("--kv-cache-bytes", type=parse_size, default=256 << 20, metavar="SIZE")
    bench.add_argument("--threads", type=int, metavar="N", help="torch threads while measuring (default: torch's)")
    bench.add_argument("--expert-memory", type=parse_size, metavar="SIZE", help="calibrate with the routed experts "
                       "offloaded (this much on the device): the profile records the expert bytes each forward "
                       "moved, and plan's cost model uses them")
    bench.add_argument("--expert-host-memory", type=parse_size, metavar="SIZE",
                       help="host memory for experts (the rest is read from disk)")
    bench.add_argument("--quick", action="store_true", help="a smaller grid (for tests)")
    bench.set_defaults(handler=run_bench_command)


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    from .cost import ExpertTiers, build_cost
    from .profiles import FittedProfile, load_profile
    from .shapes import load_shape
    from .workload import load_lengths, synthetic

    if args.seed < 0:
        raise PlanError(f"--seed must be >= 0, got {args.seed}")
    profile = load_profile(args.profile)
    if isinstance(profile, FittedProfile) and args.model and Path(args.model).name != profile.model:
        print(f"batchgen plan: warning: profile {profile.name} was measured with {profile.model}; its fitted "
              f"step times are used as they are, --model {args.model} only tokenizes --lengths", file=sys.stderr)
    model = args.model or (None if isinstance(profile, FittedProfile) else "qwen3-30b-a3b")
    shape = load_shape(model) if model and not isinstance(profile, FittedProfile) else None
    if shape is not None and args.expert_memory is not None and not shape.num_experts:
        print(f"batchgen plan: warning: {shape.name} is dense: --expert-memory has no routed experts to offload",
              file=sys.stderr)
    cost = build_cost(profile, shape, ExpertTiers(args.expert_memory))
    if args.lengths is not None:
        if args.order is not None:
            raise PlanError(f"--order {args.order} orders a synthetic workload; a --lengths file runs in its own order")
        with contextlib.ExitStack() as stack:
            workload = load_lengths(_local_lengths(args.lengths, stack), Path(args.model) if args.model else None,
                                    args.workload, args.seed)
        if args.rows is not None:
            if args.rows < 1:
                raise PlanError(f"--rows must be >= 1, got {args.rows}")
            workload = workload.head(args.rows)
    elif args.rows is None:
        raise PlanError("give --rows N (a synthetic workload) or --lengths FILE")
    else:
        workload = synthetic(args.workload, args.rows, args.seed, args.order or "random")
    pool = cost.kv_capacity_tokens
    if not (workload.prompt_len + workload.output_len <= pool).any():
        raise PlanError(f"no row fits one worker's KV pool of {pool} tokens (the shortest needs "
                        f"{int((workload.prompt_len + workload.output_len).min())}): every row would fail")
    name = shape.name if shape else getattr(profile, "model", "?")
    offload = f", experts on device {args.expert_memory / 2**30:.1f} GiB" if args.expert_memory is not None else ""
    return workload, cost, profile, f"{name} on {profile.name}{offload}"


def _setting(given: int | None, measured: object, default: int) -> int:
    """An engine setting: the flag, else the calibrated engine's (a fitted profile predicts that
    engine, `batchgen run`'s defaults), else the GPU default."""
    if given is not None:
        return given
    return measured if isinstance(measured, int) and not isinstance(measured, bool) and measured >= 1 else default


def run_plan_command(args: argparse.Namespace) -> int:
    from .cluster import ClusterSimConfig
    from .engine_config import EngineSimConfig
    from .planner import failed_rows_warning, format_report, run_plan
    from .policies import POLICIES
    from .profiles import FittedProfile

    if args.workers is None and not args.sweep_workers:
        raise PlanError("give --workers W (or --sweep-workers LIST)")
    if args.workers is not None and args.workers < 1:
        raise PlanError(f"--workers must be >= 1, got {args.workers}")
    if args.png:  # before the simulation, not after it
        import importlib.util

        if not args.png.expanduser().parent.is_dir():
            raise PlanError(f"--png {args.png}: no such directory {args.png.expanduser().parent}")
        if importlib.util.find_spec("matplotlib") is None:
            raise PlanError("--png needs matplotlib: pip install 'batchgen[plot]'")
    workload, cost, profile, what = _load(args)
    measured = profile.fit.get("engine") if isinstance(profile, FittedProfile) else None
    measured = measured if isinstance(measured, dict) else {}
    engine = EngineSimConfig(_setting(args.max_num_seqs, measured.get("max_num_seqs"), 256),
                             _setting(args.max_num_batched_tokens, measured.get("max_num_batched_tokens"), 8192))
    counts = list(dict.fromkeys(([args.workers] if args.workers is not None else []) + (args.sweep_workers or [])))
    if args.processes is not None and args.processes < 1:
        raise PlanError(f"--processes must be >= 1, got {args.processes}")
    processes = args.processes or ((os.cpu_count() or 1) if workload.rows >= PARALLEL_ROWS else 1)
    policies = tuple(POLICIES[name] for name in args.policies)
    reports = [run_plan(workload, cost, engine, ClusterSimConfig(w, processes=processes), policies,
                        keep_timelines=bool(args.png) and i == 0) for i, w in enumerate(counts)]
    if args.png:
        from .chart import draw_utilization

        draw_utilization(reports[0], args.png)
    if args.json:
        warning = failed_rows_warning(reports[0])
        if warning:
            print(f"batchgen plan: {warning}", file=sys.stderr)
        out = reports[0].to_json()
        if len(reports) > 1:
            out = {**out, "sweep": {str(r.workers): r.to_json() for r in reports}}
        print(json.dumps(out))
        return 0
    rows = f"{workload.rows} rows ({workload.name}, {workload.output_tokens} output tokens)"
    print(format_report(reports[0], f"batchgen plan: {rows}, {counts[0]} x {what}"))
    if len(reports) > 1:
        print("\nsweep (simulated): workers, BCT and GPU-hours per policy")
        names = [r.policy for r in reports[0].results]
        print(f"{'workers':>8} " + " ".join(f"{n + ' BCT':>14} {n + ' GPU-h':>14}" for n in names)
              + f" {'ideal BCT':>12}")
        for rep in sorted(reports, key=lambda r: r.workers):
            cells = " ".join(f"{r.bct_s:14.1f} {r.gpu_hours:14.2f}" for r in rep.results)
            print(f"{rep.workers:8d} {cells} {rep.ideal.bct_s:12.1f}")
    if args.png:
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def run_bench_command(args: argparse.Namespace) -> int:
    from .calibrate import calibrate
    from .profiles import save_profile

    if not args.output.expanduser().parent.is_dir():  # before minutes of measuring, not after
        raise PlanError(f"-o {args.output}: no such directory {args.output.expanduser().parent}")
    offload = {k: v for k, v in (("expert_memory_bytes", args.expert_memory),
                                 ("expert_host_memory_bytes", args.expert_host_memory)) if v is not None}
    profile = calibrate(args.calibrate, dtype=args.dtype, device=args.device, kv_cache_bytes=args.kv_cache_bytes,
                        quick=args.quick, threads=args.threads, **offload)
    save_profile(profile, args.output)
    traffic = profile.expert_traffic
    moved = (f", experts moved {(traffic['expert_bytes_from_host'] + traffic['expert_bytes_from_disk']) / 2**20:.2f} "
             "MiB per generated token" if traffic else "")
    print(f"batchgen bench: wrote {args.output}: fit over {profile.fit.get('points')} steps, "
          f"median relative error {profile.fit.get('median_rel_error', 0):.1%}{moved}", file=sys.stderr)
    return 0
