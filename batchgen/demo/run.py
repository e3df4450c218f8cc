"""`batchgen demo`: the trained demo model cleans the bundled table of messy dates.

Writes the rows as a Parquet job (prompt = DEMO_PROMPT around each messy date), runs it the way
`batchgen run` does (in-process engine, or a local Dask cluster with --workers), then scores
the output against the bundled answers.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .accuracy import parse_iso
from .prompt import DEMO_MAX_TOKENS, DEMO_PROMPT
from .table import table_rows


def run_demo(args: argparse.Namespace, execute: Callable[[Any, Path, argparse.Namespace], Any]) -> int:
    """execute(spec, model, args) -> JobSummary: the CLI's runner (engine or cluster)."""
    import pandas as pd

    from ..errors import BatchgenError
    from ..io.spec import JobSpec
    from . import demo_model_dir

    output: Path = args.output
    if output.suffix.lower() != ".parquet":
        raise BatchgenError(f"--output {output}: the demo writes Parquet; use a .parquet name")
    rows = table_rows()[:args.rows] if getattr(args, "rows", None) else table_rows()
    output.parent.mkdir(parents=True, exist_ok=True)
    source = output.with_name(output.stem + ".input.parquet")
    pd.DataFrame({"id": [r["id"] for r in rows], "signup": [r["signup"] for r in rows],
                  "prompt": [DEMO_PROMPT.format(text=r["signup"]) for r in rows]}).to_parquet(source, index=False)
    spec = JobSpec(input=source, output=output, overwrite=True, id_column="id",
                   defaults={"temperature": 0.0, "max_tokens": DEMO_MAX_TOKENS})
    spec.check()
    model = demo_model_dir()
    where = f"a local Dask cluster of {args.workers} workers" if args.workers else (
        f"the cluster at {args.scheduler}" if args.scheduler else "one in-process engine")
    print(f"batchgen demo: cleaning {len(rows)} messy dates with the demo model ({model.name}, "
          f"a tiny Mixtral-layout MoE) on {where} ...", file=sys.stderr)
    summary = execute(spec, model, args)

    result = pd.read_parquet(output)
    answers = {r["id"]: r["iso"] for r in rows}
    parsed = [parse_iso(t) if isinstance(t, str) else None for t in result["generated_text"]]
    right = [p == answers[i] for p, i in zip(parsed, result["id"])]
    for i, signup, text, ok in list(zip(result["id"], result["signup"], result["generated_text"], right))[:6]:
        print(f"  {signup!r:34} -> {text!r}" + ("" if ok else f"   (wrong: expected {answers[i]})"))
    n_right = sum(right)
    print(f"batchgen demo: accuracy {n_right}/{len(rows)} ({100 * n_right / len(rows):.1f}%) against the "
          f"bundled answers; {sum(p is not None for p in parsed)} well-formed dates")
    print(f"batchgen demo: wrote {output}: {summary.describe()}")
    return 0
