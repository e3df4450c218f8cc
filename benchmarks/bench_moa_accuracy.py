"""Accuracy of Mixture-of-Agents with and without the agreement bypass, on the demo task.

Proposers: the trained demo variants shipped in batchgen/demo/variants/ (Mixtral-layout MoEs of
different sizes and seeds, trained by scripts/train_demo_model.py on the messy-date task, their
accuracies spread on purpose). Aggregator: the shipped demo model (`--aggregator demo`) or a
variant (`--aggregator NAME`). Rows: fresh dates (`--seed`, not a training seed) with known answers;
every answer goes through `extract` = a valid YYYY-MM-DD date or None.

Printed, in one run:
- each model alone (batchgen.Engine, greedy), and checked equal to its MoA answer column;
- majority vote only (agreement.vote over the proposers' answers; ties: the earliest proposer),
  and the share of rows some proposer got right (what a perfect selector could reach);
- MoA at skip_threshold inf (always aggregate), 1.0 and each strict majority below it (k=3: 2/3),
  with two aggregator templates:
  `reads`  = batchgen's default text template (the proposals before the row's prompt), which the
             aggregator was never trained to read;
  `prompt` = "{prompt}": the aggregator gets the row's own prompt, the one it was trained on, and
             ignores the proposals (aggregation = asking the aggregator model);
  accuracy in % and its difference from always-aggregate in percentage points, rows skipped, the
  aggregator stage's time (job.stats: its first submission -> its last output, overlapped with the
  expert stage) and the aggregator's own work (it alone, in this process, on exactly the rows and
  prompts it got), each with its ratio to always-aggregate's (best of --repeat, interleaved).

    nice -n 10 python benchmarks/bench_moa_accuracy.py [--rows 600] [--seed 7] [--repeat 2] [--workers 0]

--workers 0 (default) runs every model in this process (one torch thread); --workers 2 on a
LocalCluster of 2 processes (1 thread each). chat=False: the plain DEMO_PROMPT, which the models
were trained on (chat messages give the same tokens: tests/test_demo.py).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

# k=3, strongest first (vote ties go to the earliest): about 95%, 89% and 62% alone
DEFAULT_PROPOSERS = ["h64-l2-seed11", "h48-l2-seed12", "h64-l2-seed17"]
TEMPLATES: dict[str, str | None] = {"reads": None, "prompt": "{prompt}"}


def thresholds(k: int) -> list[float]:
    """inf (always aggregate), 1.0 (all agree), then each strict majority j/k below it (k=3: 2/3)."""
    return [float("inf"), 1.0, *(j / k for j in range(k - 1, k // 2, -1))]
SAMPLING = {"temperature": 0.0, "max_tokens": 16}


def rows(n: int, seed: int) -> pd.DataFrame:
    from batchgen.demo import DEMO_PROMPT, variant_dirs
    from batchgen.demo.accuracy import TRAINING_SEEDS
    from batchgen.demo.dates import messy_dates

    used = set(TRAINING_SEEDS)
    for d in variant_dirs().values():  # each variant's data and tokenizer seeds
        s = json.loads((d / "training.json").read_text())["args"]["seed"]
        used |= {s, s + 1}
    if seed in used:
        raise SystemExit(f"--seed {seed} is one a model was trained on; pick another")
    dates = messy_dates(n, seed)
    return pd.DataFrame({"prompt": [DEMO_PROMPT.format(text=d.text) for d in dates],
                         "gold": [d.iso for d in dates], "format": [d.format for d in dates]})


def alone(dirs: Mapping[str, Path], pdf: pd.DataFrame) -> dict[str, list[str | None]]:
    """Each model's extracted answers, run alone on one Engine in this process."""
    from batchgen import SamplingParams
    from batchgen.demo.accuracy import parse_iso

    params = SamplingParams(**SAMPLING)
    answers = {}
    for name, d in dirs.items():
        outs = _engine(d).generate(pdf["prompt"].tolist(), params)
        answers[name] = [parse_iso(o.text) if o.error is None else None for o in outs]
    return answers


def run(dirs: Mapping[str, Path], proposers: list[str], aggregator: str, pdf: pd.DataFrame, threshold: float,
        template: str | None, client: Any) -> tuple[pd.DataFrame, dict]:
    from batchgen.demo.accuracy import parse_iso
    from batchgen.moa import MoA

    if client is not None:
        import batchgen.cluster as bc

        bc.release(client)  # the same start for every run: no engine loaded
    job = MoA({n: dirs[n] for n in proposers}, aggregator=aggregator, models={aggregator: dirs[aggregator]},
              k=len(proposers), skip_threshold=threshold, extract=parse_iso, default_sampling=SAMPLING,
              chat=False, template=template, client=client, rows_per_task=32)
    out = job.generate(pdf)
    agg = out[out["aggregated"]]
    # what the aggregator got: its template over the row's prompt and its proposers' texts
    prompts = [job._prompt(aggregator, row["prompt"], [row[f"{n}_text"] for n in proposers
                                                       if isinstance(row[f"{n}_text"], str)])
               for _, row in agg.iterrows()]
    return out, {**job.stats.as_dict(), "aggregator_work_s": aggregator_work(dirs[aggregator], prompts)}


def aggregator_work(model: Path, prompts: list) -> float:
    """Seconds the aggregator alone (one Engine in this process) takes on the rows it got: its
    work, which the overlapped aggregator_stage_s (first submission -> last output) hides."""
    from batchgen import SamplingParams

    if not prompts:
        return 0.0
    engine = _engine(model)
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(**SAMPLING))
    return time.perf_counter() - t0


_ENGINES: dict[Path, Any] = {}


def _engine(model: Path) -> Any:
    from batchgen import Engine

    if model not in _ENGINES:
        _ENGINES[model] = Engine(model)
    return _ENGINES[model]


def pct(hits: pd.Series | list[bool]) -> float:
    s = pd.Series(list(hits), dtype=bool)
    return 100.0 * float(s.mean()) if len(s) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=2, help="runs per configuration, interleaved (times: best)")
    ap.add_argument("--workers", type=int, default=0, help="0: in this process; N: a LocalCluster of N")
    ap.add_argument("--aggregator", default="demo", help="'demo' (the shipped model) or a variant's name")
    ap.add_argument("--proposers", nargs="*", default=DEFAULT_PROPOSERS,
                    help=f"variant names (default: {' '.join(DEFAULT_PROPOSERS)}; 'all': every shipped variant)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    import torch

    from batchgen.demo import demo_model_dir, variant_dirs
    from batchgen.moa import vote

    torch.set_num_threads(1)
    variants = variant_dirs()
    proposers = list(variants) if args.proposers == ["all"] else args.proposers
    unknown = [p for p in proposers + [args.aggregator] if p != "demo" and p not in variants]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; variants: {list(variants)} (or 'demo')")
    dirs = {**variants, "demo": demo_model_dir()}
    pdf = rows(args.rows, args.seed)
    gold = pdf["gold"].tolist()
    report: dict[str, Any] = {"rows": len(pdf), "seed": args.seed, "proposers": proposers,
                              "aggregator": args.aggregator, "workers": args.workers}

    t0 = time.perf_counter()
    solo = alone({n: dirs[n] for n in dict.fromkeys(proposers + [args.aggregator])}, pdf)
    solo_acc = {n: pct(a == g for a, g in zip(ans, gold)) for n, ans in solo.items()}
    votes = [vote([solo[p][i] for p in proposers]) for i in range(len(pdf))]
    majority = pct(v.majority == g for v, g in zip(votes, gold))
    any_right = pct(any(solo[p][i] == g for p in proposers) for i, g in enumerate(gold))
    print(f"{len(pdf)} fresh dates (seed {args.seed}); models alone took {time.perf_counter() - t0:.0f} s", flush=True)
    for n, a in solo_acc.items():
        print(f"  {n:>12} alone: {a:5.1f}%", flush=True)
    print(f"  majority vote of {len(proposers)}: {majority:.1f}%; some proposer right: {any_right:.1f}%", flush=True)
    report.update(alone=solo_acc, majority_vote=majority, some_proposer_right=any_right)

    client = cluster = None
    if args.workers:
        from distributed import Client, LocalCluster

        import batchgen.cluster as bc

        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0")
        client = Client(cluster)
        bc.connect(client=client, push_interval=0.2)
    try:
        run(dirs, proposers, args.aggregator, pdf.head(16), 1.0, None, client)  # warm-up: loads, imports
        configs = [(t, th) for t in TEMPLATES for th in thresholds(len(proposers))]
        results: dict[tuple[str, float], dict] = {}
        for rep in range(args.repeat):
            for tname, th in configs:
                out, stats = run(dirs, proposers, args.aggregator, pdf, th, TEMPLATES[tname], client)
                right = (out["final_answer"].astype(object) == pdf["gold"]).tolist()
                prev = results.get((tname, th))
                if prev is None:
                    for p in proposers:  # the MoA columns are each model alone
                        moa = [None if pd.isna(a) else a for a in out[f"{p}_answer"]]
                        differ = sum(a != b for a, b in zip(moa, solo[p]))
                        if differ:
                            print(f"  WARNING: {p}'s MoA answers differ from it alone on {differ} rows", flush=True)
                    skipped = ~out["aggregated"]
                    results[(tname, th)] = {"right": right, "skipped": skipped.tolist(), **stats,
                                            "agg_runs": [stats["aggregator_stage_s"]], "total_runs": [stats["total_s"]],
                                            "work_runs": [stats["aggregator_work_s"]]}
                else:
                    if right != prev["right"]:
                        print(f"  WARNING: {tname} {th}: accuracy changed between repeats", flush=True)
                    prev["agg_runs"].append(stats["aggregator_stage_s"])
                    prev["total_runs"].append(stats["total_s"])
                    prev["work_runs"].append(stats["aggregator_work_s"])
                print(f"  run {rep + 1}: template {tname}, threshold {th:.3g}: {pct(right):.1f}%, "
                      f"skipped {stats['rows_skipped']}, aggregator stage {stats['aggregator_stage_s']:.2f} s, "
                      f"total {stats['total_s']:.2f} s, aggregator alone on its rows {stats['aggregator_work_s']:.2f} s",
                      flush=True)
    finally:
        if client is not None:
            client.close()
            cluster.close()

    print(f"\nMoA: proposers {', '.join(proposers)} (k={len(proposers)}), aggregator {args.aggregator}, "
          f"{len(pdf)} rows, {'in-process' if not args.workers else f'LocalCluster of {args.workers}'}, "
          f"best of {args.repeat}")
    print("| template | skip_threshold | accuracy | vs always-aggregate | rows skipped | accuracy of skipped rows "
          "(bypass / aggregator) | aggregator stage (overlapped) | ratio | aggregator alone on its rows | ratio | total |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    report["moa"] = []
    for tname in TEMPLATES:
        base = results[(tname, float("inf"))]
        base_agg, base_acc, base_work = min(base["agg_runs"]), pct(base["right"]), min(base["work_runs"])
        for th in thresholds(len(proposers)):
            r = results[(tname, th)]
            acc, agg, work = pct(r["right"]), min(r["agg_runs"]), min(r["work_runs"])
            sk = [i for i, s in enumerate(r["skipped"]) if s]
            sk_bypass, sk_agg = pct(r["right"][i] for i in sk), pct(base["right"][i] for i in sk)
            ratio = agg / base_agg if base_agg else float("nan")
            work_ratio = work / base_work if base_work else float("nan")
            on_skipped = f"{sk_bypass:.1f}% / {sk_agg:.1f}%" if sk else "-"
            print(f"| {tname} | {th:.3g} | {acc:.1f}% | {acc - base_acc:+.1f} pp | {len(sk)} / {len(pdf)} | "
                  f"{on_skipped} | {agg:.2f} s | {ratio:.2f}x | {work:.2f} s | {work_ratio:.2f}x | {min(r['total_runs']):.2f} s |")
            report["moa"].append({"template": tname, "skip_threshold": th, "accuracy": acc,
                                  "pp_vs_always": acc - base_acc, "rows_skipped": len(sk),
                                  "skipped_accuracy_bypass": sk_bypass, "skipped_accuracy_aggregator": sk_agg,
                                  "aggregator_stage_s": agg, "aggregator_ratio": ratio,
                                  "aggregator_work_s": work, "aggregator_work_ratio": work_ratio,
                                  "total_s": min(r["total_runs"])})
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
