"""A Dask DataFrame of messy dates through batchgen's trained demo model on a local cluster (or
`--scheduler tcp://...`): a column of chat messages built from the raw text, rendered by the
model's chat template on the workers, answers checked against the truth.

    python examples/dask_dataframe.py [--model DIR] [--scheduler ADDR] [--rows 64]
"""
from __future__ import annotations

import argparse

import dask.dataframe as dd
import pandas as pd

import batchgen
from batchgen.demo import DEMO_INSTRUCTION, DEMO_MAX_TOKENS, demo_model_dir
from batchgen.demo.dates import messy_dates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model directory or Hugging Face id (default: the trained demo model)")
    ap.add_argument("--scheduler", help="Dask scheduler address (default: start a LocalCluster)")
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    model = args.model or str(demo_model_dir())
    client = batchgen.cluster.connect(scheduler_address=args.scheduler)
    dates = messy_dates(args.rows, seed=11)
    pdf = pd.DataFrame({"raw": [d.text for d in dates], "truth": [d.iso for d in dates]})
    pdf["messages"] = [[{"role": "user", "content": DEMO_INSTRUCTION.format(text=t)}] for t in pdf["raw"]]
    ddf = dd.from_pandas(pdf, npartitions=4)
    out = ddf.map_partitions(batchgen.generate, model=model, messages_column="messages", temperature=0.0,
                             max_tokens=DEMO_MAX_TOKENS)
    result = out.compute()
    right = int((result["generated_text"] == result["truth"]).sum())
    print(result[["raw", "generated_text", "finish_reason", "num_input_tokens"]].head(8).to_string())
    print(f"exact match: {right}/{len(result)}")
    print("cluster:", batchgen.cluster.metrics(client).get("totals"))  # as the workers last pushed (every 0.2 s)
    client.close()


if __name__ == "__main__":
    main()
