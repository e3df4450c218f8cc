"""A Dask DataFrame of prompts through batchgen on a local cluster (or `--scheduler tcp://...`).

    python examples/dask_dataframe.py [--model DIR] [--scheduler ADDR] [--rows 64]
"""
from __future__ import annotations

import argparse

import dask.dataframe as dd
import pandas as pd

import batchgen
from batchgen.demo import build_demo_model, default_demo_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model directory (default: the demo model)")
    ap.add_argument("--scheduler", help="Dask scheduler address (default: start a LocalCluster)")
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    model = args.model or str(build_demo_model(default_demo_dir()))
    client = batchgen.cluster.connect(scheduler_address=args.scheduler)
    topics = ["lists", "dictionaries", "generators", "decorators", "exceptions", "classes", "modules", "sets"]
    pdf = pd.DataFrame({"prompt": [f"Explain Python {topics[i % len(topics)]} (#{i})" for i in range(args.rows)],
                        "max_tokens": [8 + (i * 7) % 48 for i in range(args.rows)]})
    ddf = dd.from_pandas(pdf, npartitions=4)
    out = ddf.map_partitions(batchgen.generate, model=model, temperature=0.0, per_row={"max_tokens": "max_tokens"})
    result = out.compute()
    print(result[["prompt", "num_generated_tokens", "finish_reason"]].head(8).to_string())
    print("cluster:", batchgen.cluster.metrics(client).get("totals"))
    client.close()


if __name__ == "__main__":
    main()
