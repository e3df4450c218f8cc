"""ETL: clean the messy sign-up dates of a customer table with the demo model, on Dask.

    python examples/etl_cleaning.py [--input customers.parquet] [--out-dir etl_out]
                                    [--rows 200] [--workers 2 | --scheduler tcp://...]

customers.parquet (customer_id, name, country, signup as people typed it) -> dd.read_parquet ->
map_partitions(batchgen.generate) with the demo model's prompt -> etl_out/clean.parquet (the
same columns plus `signup_date`, a parsed date) and etl_out/failed.parquet (rows whose date
could not be read: no input, an engine error, or an answer that is not a valid YYYY-MM-DD).
Without --input a sample table is written first (etl_out/customers.parquet).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import dask.dataframe as dd
import pandas as pd
from distributed import wait

import batchgen
from batchgen.demo import DEMO_MAX_TOKENS, DEMO_PROMPT, demo_model_dir
from batchgen.demo.dates import messy_date

NAMES = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Radia", "John"]
COUNTRIES = ["DE", "US", "FR", "IN", "BR", "JP", "NG", "CA"]


def sample_customers(path: Path, rows: int, seed: int = 42) -> pd.DataFrame:
    """A customer table with the answers kept aside (`true_signup`), and one row with no date."""
    rng = random.Random(seed)
    dates = [messy_date(rng) for _ in range(rows)]
    pdf = pd.DataFrame({
        "customer_id": range(1000, 1000 + rows),
        "name": [f"{rng.choice(NAMES)} {chr(65 + i % 26)}." for i in range(rows)],
        "country": [rng.choice(COUNTRIES) for _ in range(rows)],
        "signup": pd.array([d.text for d in dates], dtype="string"),
        "true_signup": [d.iso for d in dates],
    })
    pdf.loc[rows // 2, "signup"] = pd.NA  # a missing value, as real exports have
    pdf.to_parquet(path, index=False)
    return pdf


def with_prompt(pdf: pd.DataFrame) -> pd.DataFrame:
    prompts = [DEMO_PROMPT.format(text=t) if isinstance(t, str) else None for t in pdf["signup"]]
    return pdf.assign(prompt=pd.Series(prompts, index=pdf.index, dtype="string"))


def parse_dates(pdf: pd.DataFrame) -> pd.DataFrame:
    """`signup_date`: the model's answer as a date (NaT when it is not a valid YYYY-MM-DD)."""
    text = pdf["generated_text"].astype("string").str.strip()
    parsed = pd.to_datetime(text.where(text.str.fullmatch(r"\d{4}-\d{2}-\d{2}", na=False)),
                            format="%Y-%m-%d", errors="coerce")
    return pdf.assign(signup_date=parsed)


def clean(input_path: Path, out_dir: Path, client: Any) -> dict[str, Any]:
    ddf = dd.read_parquet(input_path)
    ddf = ddf.map_partitions(with_prompt)
    out = ddf.map_partitions(batchgen.generate, model=str(demo_model_dir()), temperature=0.0,
                             max_tokens=DEMO_MAX_TOKENS)
    out = out.map_partitions(parse_dates)
    with batchgen.cluster.progress(client, total=len(ddf)):
        out = client.persist(out)
        wait(out)
    keep = [c for c in ddf.columns if c != "prompt"] + ["signup_date"]
    good = out[out["signup_date"].notnull()][keep]
    bad = out[out["signup_date"].isnull()][[c for c in ddf.columns if c != "prompt"] + ["generated_text", "error"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    good.to_parquet(out_dir / "clean.parquet", write_index=False, overwrite=True)
    failed = bad.compute()
    failed.to_parquet(out_dir / "failed.parquet", index=False)
    return {"rows": len(out), "clean": len(good), "failed": failed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", type=Path, help="customer Parquet with a `signup` column (default: a sample)")
    ap.add_argument("--out-dir", type=Path, default=Path("etl_out"))
    ap.add_argument("--rows", type=int, default=200, help="rows of the sample table")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="local cluster size (without --scheduler)")
    ap.add_argument("--scheduler", help="Dask scheduler address (default: start a LocalCluster)")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    source = args.input
    if source is None:
        source = args.out_dir / "customers"
        source.mkdir(exist_ok=True)
        pdf = sample_customers(source / "part.0.parquet", args.rows)
        if args.partitions > 1:  # several files: several partitions, spread over the workers
            (source / "part.0.parquet").unlink()
            step = -(-len(pdf) // args.partitions)
            for i in range(0, len(pdf), step):
                pdf.iloc[i:i + step].to_parquet(source / f"part.{i // step}.parquet", index=False)
    client = batchgen.cluster.connect(scheduler_address=args.scheduler, n_workers=args.workers)
    cluster = None if args.scheduler else client.cluster
    try:
        report = clean(source, args.out_dir, client)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    cleaned = pd.read_parquet(args.out_dir / "clean.parquet")
    print(cleaned.head(8).to_string(index=False))
    if "true_signup" in cleaned:
        right = (cleaned["signup_date"].dt.strftime("%Y-%m-%d") == cleaned["true_signup"]).sum()
        print(f"{right}/{report['rows']} dates match the sample's answers")
    failed = report["failed"]
    print(f"{report['clean']} of {report['rows']} rows cleaned -> {args.out_dir / 'clean.parquet'}; "
          f"{len(failed)} failed -> {args.out_dir / 'failed.parquet'}:")
    for row in failed.itertuples(index=False):
        print(f"  customer {row.customer_id}: signup {row.signup!r} -> {row.generated_text!r} "
              f"({'not a valid YYYY-MM-DD' if pd.isna(row.error) else row.error})")
    return report


if __name__ == "__main__":
    main()
