"""`batchgen moa --config moa.toml --input rows.jsonl|.parquet --output out.jsonl|.parquet`.

moa.toml (tomllib, stdlib; or moa.yaml with the same keys)::

    aggregator = "big"            # a proposer's name or one of [models]
    k = 3                         # experts per row; layers = 1; skip_threshold = 1.0
    extract = "choice"            # choice | boxed | number | json:FIELD | regex:PATTERN | text
    route = "experts"             # optional: column listing each row's experts (default: all)
    placement = "ilp"             # ilp | round_robin | data_parallel
    prompt_column = "prompt"
    workers = 2                   # a local Dask cluster; or scheduler = "tcp://host:8786"; neither: this process
    [proposers]
    small = "/models/small"
    big = "/models/big"
    [models]                      # optional: an aggregator that is not a proposer
    [sampling.default]            # SamplingParams fields for every model
    max_tokens = 64
    [sampling.big]                # and per model
    max_tokens = 1024

Input rows: JSONL objects (one per line) or Parquet; all columns pass through. The output is
written once the job ends (not incrementally, not resumable: that is `batchgen run`'s).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import BatchgenError

KEYS = {"aggregator", "k", "layers", "skip_threshold", "extract", "route", "placement", "prompt_column",
        "workers", "scheduler", "proposers", "models", "sampling", "chat", "template", "engine_options",
        "rows_per_task", "time_limit_s"}


def add_command(sub: Any) -> None:
    p = sub.add_parser("moa", help="Mixture-of-Agents over several models (MOSAIC placement, aggregator bypass)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, metavar="TOML|YAML")
    p.add_argument("--input", required=True, type=Path, metavar="FILE", help=".jsonl or .parquet")
    p.add_argument("--output", required=True, type=Path, metavar="FILE", help="same format as --input")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(handler=main)


def load_config(path: Path) -> dict[str, Any]:
    from .backend import read_map_file

    config = read_map_file(path, "--config")
    unknown = set(config) - KEYS
    if unknown:
        raise BatchgenError(f"--config {path}: unknown keys {sorted(unknown)}; known: {sorted(KEYS)}")
    for key in ("proposers", "aggregator"):
        if key not in config:
            raise BatchgenError(f"--config {path}: missing {key!r}")
    return config


def main(args: argparse.Namespace) -> int:
    import pandas as pd

    from .mixture import MoA

    config = load_config(args.config)
    suffix = args.input.suffix.lower()
    if suffix not in (".jsonl", ".parquet") or args.output.suffix.lower() != suffix:
        raise BatchgenError("--input must be .jsonl or .parquet and --output the same format")
    if not args.input.is_file():
        raise BatchgenError(f"--input {args.input}: no such file")
    if args.output.exists() and not args.overwrite:
        raise BatchgenError(f"--output {args.output} exists; pass --overwrite")
    try:
        frame = pd.read_parquet(args.input) if suffix == ".parquet" else pd.read_json(args.input, lines=True)
    except Exception as exc:  # noqa: BLE001 - pyarrow's and pandas' parse errors: one message, exit 2
        raise BatchgenError(f"--input {args.input}: cannot read it: {exc}") from None
    if len(frame) == 0 and len(frame.columns) == 0:  # an empty .jsonl: no rows, hence no columns either
        frame = pd.DataFrame({config.get("prompt_column", "prompt"): pd.Series([], dtype=object)})
    for key in ("prompt_column", "route"):
        column = config.get(key, "prompt" if key == "prompt_column" else None)
        if column is not None and column not in frame.columns:
            raise BatchgenError(f"--config {key} = {column!r} is not a column of --input; columns: {list(frame.columns)}")
    sampling = config.get("sampling", {})
    if not isinstance(sampling, dict):
        raise BatchgenError(f"--config {args.config}: sampling must be a table ([sampling.default], [sampling.NAME])")
    sampling = dict(sampling)
    workers = config.get("workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise BatchgenError(f"--config {args.config}: workers must be an integer >= 0, got {workers!r}")
    default = sampling.pop("default", None)
    client = cluster = None
    if config.get("scheduler") or config.get("workers"):
        from distributed import Client

        from ..cluster.client import connect, local_cluster

        cluster = None if config.get("scheduler") else local_cluster(workers)
        client = connect(client=Client(config["scheduler"]) if config.get("scheduler") else Client(cluster))
    try:
        try:
            job = MoA(config["proposers"], config["aggregator"], route=config.get("route"), k=config.get("k", 3),
                      layers=config.get("layers", 1), skip_threshold=config.get("skip_threshold", 1.0),
                      extract=config.get("extract"), sampling=sampling, default_sampling=default,
                      models=config.get("models"), prompt_column=config.get("prompt_column", "prompt"),
                      chat=config.get("chat"), template=config.get("template"), client=client,
                      placement=config.get("placement", "ilp"), engine_options=config.get("engine_options"),
                      rows_per_task=int(config["rows_per_task"]) if "rows_per_task" in config else None,
                      time_limit_s=float(config.get("time_limit_s", 5.0)))
        except (TypeError, ValueError) as exc:  # a value of the wrong type (engine_options, rows_per_task, ...)
            raise BatchgenError(f"--config {args.config}: {exc}") from None
        out = job.generate(frame)
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        out.to_parquet(args.output)
    elif len(out):
        out.to_json(args.output, orient="records", lines=True, force_ascii=False)
    else:  # pandas writes a lone newline for no rows: an empty line is no JSON record
        args.output.write_text("")
    print(f"batchgen moa: wrote {args.output}: {json.dumps(job.stats.as_dict())}", file=sys.stderr)
    return 0
