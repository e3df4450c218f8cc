"""The command line's parser: `batchgen run`, `demo` and `report` here, `plan`/`bench` from
batchgen/sim/cli.py and `moa` from batchgen/moa/cli.py; and the option dicts the flags give."""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (flag, SamplingParams field, type, help); unset flags keep SamplingParams' (vLLM's) defaults.
_SAMPLING_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--max-tokens", "max_tokens", int, "tokens to generate at most (default 16)"),
    ("--min-tokens", "min_tokens", int, "tokens to generate before EOS/stop may end a row"),
    ("--temperature", "temperature", float, "0 is greedy (default 1.0)"),
    ("--top-p", "top_p", float, "nucleus sampling mass in (0, 1]"),
    ("--top-k", "top_k", int, "sample among the k most likely tokens; 0 or -1: off"),
    ("--min-p", "min_p", float, "drop tokens below min_p times the top probability"),
    ("--seed", "seed", int, "per-row seed, so sampled rows are reproducible"),
    ("--presence-penalty", "presence_penalty", float, "in [-2, 2]"),
    ("--frequency-penalty", "frequency_penalty", float, "in [-2, 2]"),
    ("--repetition-penalty", "repetition_penalty", float, "> 0; 1 is off"),
    ("--logprobs", "logprobs", int, "return the sampled token's logprob and the top N"),
]


def build_parser() -> argparse.ArgumentParser:
    from batchgen import __version__

    parser = argparse.ArgumentParser(
        prog="batchgen", description="Batch (offline) inference of Mixture-of-Experts LLMs.")
    parser.add_argument("--version", action="version", version=f"batchgen {__version__}")
    _add_log_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run", help="run a JSONL or Parquet file of requests through a model",
        description="Run every row of --input through the model and write one result or error "
        "per row to --output. Paths are local or fsspec URLs (s3://, gs://, abfs://, memory://; "
        "http(s):// for input). Input by name: .jsonl, optionally .gz/.bz2/.zst/.xz (OpenAI batch: "
        "custom_id, method, url /v1/completions or /v1/chat/completions, body) or .parquet (one "
        "prompt per row; all columns pass through); a glob or a directory of them (a Parquet "
        "dataset, hive partitions included). Output by name: .jsonl, .parquet (one file), or any "
        "other name: a Parquet dataset directory written as rows finish. Rows with bad values get "
        "an error record and the job goes on. Exit codes: 0 done within --max-error-rate, 3 too "
        "many failed rows, 1 engine/cluster failure, 2 could not start, 130 interrupted "
        "(docs/guides/file-jobs.md).")
    which = run.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR|ID", help="model directory (config.json, *.safetensors, "
                       "tokenizer.json) or Hugging Face id (org/name[@revision], resolved in the HF cache)")
    which.add_argument("--models", nargs="+", metavar="NAME=DIR", help="several models (or one models.toml / models.yaml): "
                       "each JSONL line runs on the model its body.model names (batchgen/moa/backend.py)")
    run.add_argument("--placement", choices=["ilp", "round_robin", "data_parallel"], default="ilp",
                     help="with --models on a cluster: how models and rows are placed on workers (default: ilp)")
    run.add_argument("--input", required=True, metavar="URL",
                     help="requests: .jsonl[.gz|.bz2|.zst|.xz] (OpenAI batch) or .parquet; a glob or a directory")
    run.add_argument("--output", required=True, metavar="URL",
                     help="results: .jsonl (JSONL input only), .parquet (one file, for small jobs) or a "
                          "directory (a Parquet dataset; an image job's: .jsonl or .parquet); written as rows finish")
    run.add_argument("--error-file", metavar="URL", help="write failed rows here instead of --output "
                     "(.jsonl, or Parquet for a Parquet input; default: failed rows are in --output)")
    run.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                     help="an fsspec storage option for every URL (e.g. anon=true, "
                          "client_kwargs.endpoint_url=http://host:9000); repeatable; over dask.config "
                          "batchgen.storage-options; credentials come from the usual environment")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue an interrupted job: "
                       "skip rows already in --output, run the rest; refused if the input, model, "
                       "sampling options or batchgen version changed")
    again.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    run.add_argument("--retry-errors", action="store_true", help="with --resume: run again the rows that "
                     "ended in a retryable (engine or cluster) error, replacing their records")
    run.add_argument("--force-resume", action="store_true", help="with --resume: finish the output even "
                     "though what decides its rows changed (mixes the two jobs' rows)")
    run.add_argument("--max-error-rate", type=float, default=0.05, metavar="RATE",
                     help="exit 3 when more than this fraction of rows failed (default: 0.05); "
                          "a job whose rows all failed never exits 0")
    run.add_argument("--summary-json", metavar="URL", help="write the job summary (request_counts, "
                     "tokens, timing) here as JSON; it is also the last line on stderr")
    run.add_argument("--report", metavar="FILE", help="with --workers or --scheduler: write the job's charts "
                     "(per-worker load, tokens/s over time, migrations) to FILE at the end, one self-contained "
                     "HTML file (needs bokeh: the dashboard extra)")
    _add_log_flags(run)
    _add_engine_flags(run)
    pq = run.add_argument_group("Parquet input")
    pq.add_argument("--prompt-column", default="prompt", metavar="NAME", help="column with the "
                    "prompt: text, token ids, or chat messages (default: prompt)")
    pq.add_argument("--id-column", metavar="NAME", help="column of unique row ids, checked and "
                    "named in error messages (default: the row number)")
    pq.add_argument("--param-column", action="append", default=[], metavar="FIELD[=COLUMN]",
                    help="take sampling field FIELD of each row from COLUMN (default: a column "
                    "named FIELD), e.g. max_tokens=max_tok; repeatable; null cells use the flags")
    pq.add_argument("--per-row-params", action="store_true", help="take every column named "
                    "like a sampling field (max_tokens, temperature, ...) as that row's value")
    _add_sampling_flags(run)

    demo = sub.add_parser("demo", help="clean a bundled table of messy dates with the shipped demo model",
                          description="Run the shipped demo model (a tiny MoE trained to normalize "
                          "messy dates to ISO 8601) on a bundled table of 300 rows, and score it "
                          "against the table's answers.")
    demo.add_argument("--rows", type=_positive, metavar="N", help="only the table's first N rows (default: all 300)")
    demo.add_argument("--output", type=Path, default=Path("demo_out/results.parquet"),
                      metavar="FILE", help="where to write the results (default: %(default)s)")
    _add_engine_flags(demo)
    _add_log_flags(demo)
    report = sub.add_parser("report", help="write a running cluster's batchgen charts to one HTML file",
                            description="Read the batchgen plugin of the cluster at --scheduler (its per-worker "
                            "load, timelines and migrations) and write the dashboard page's charts to OUTPUT, "
                            "one self-contained HTML file that opens without network access. Needs bokeh.")
    report.add_argument("output", metavar="OUTPUT", help="the HTML file to write")
    report.add_argument("--scheduler", required=True, metavar="ADDR", help="the cluster (tcp://host:8786)")
    _add_log_flags(report)
    from batchgen.sim.cli import add_commands as add_sim_commands

    add_sim_commands(sub)  # plan, bench: the simulator's commands, self-contained in sim/cli.py
    from batchgen.moa.cli import add_command as add_moa_command

    add_moa_command(sub)  # moa: batchgen/moa/cli.py
    return parser


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    """-v / -q / --log-level, on the top parser and on a command; SUPPRESS defaults, as a
    command's defaults would overwrite what the top parser read."""
    g = p.add_argument_group("logging")
    g.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="debug log lines")
    g.add_argument("-q", "--quiet", action="count", default=argparse.SUPPRESS, help="errors only")
    g.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper,
                   default=argparse.SUPPRESS, help="the batchgen logger's level (default: INFO)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", help="compute dtype: auto (the checkpoint's on CUDA, float32 on CPU; the default), "
                                  "float32, bfloat16, float16")
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--max-image-tokens", type=_positive, metavar="N",
                   help="image pipelines: the most image tokens one request may have (default: 16x the "
                        "model's native size); a larger request fails alone")
    g.add_argument("--chunk-size", type=_positive, default=1024, metavar="N",
                   help="rows in the engine at once, topped up as rows finish; bounds memory. Rows beyond the "
                        "running batch wait, grouped by shared prefix for the prefix cache (default: 1024)")
    cluster = g.add_mutually_exclusive_group()
    cluster.add_argument("--scheduler", metavar="ADDR",
                         help="run on the Dask cluster at ADDR (tcp://host:8786); the batchgen plugin is "
                              "registered on it. Default: one in-process engine (image jobs: always, for now)")
    cluster.add_argument("--workers", type=_positive, metavar="N",
                         help="start a local Dask cluster of N worker processes and run on it")
    g.add_argument("--progress", choices=["auto", "bar", "lines", "off"], default="auto",
                   help="progress on stderr: a bar on a terminal, periodic lines otherwise")
    off = p.add_argument_group("memory-constrained MoE", "routed experts tiered over device, host memory and "
                               "the checkpoint on disk; sizes like 2GiB, 512MB or a byte count")
    off.add_argument("--expert-memory", type=_size, metavar="SIZE", dest="expert_memory_bytes",
                     help="device memory for routed experts; the rest stream in from host memory")
    off.add_argument("--expert-host-memory", type=_size, metavar="SIZE", dest="expert_host_memory_bytes",
                     help="host memory for routed experts; the rest are read from the checkpoint on disk "
                          "as needed (on a CPU device this is the experts' whole footprint)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments the flags set (unset ones left to the defaults)."""
    names = ("dtype", "device", "expert_memory_bytes", "expert_host_memory_bytes")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling defaults", "each row's own body fields or parameter "
                             "columns override these")
    for flag, field, kind, text in _SAMPLING_FLAGS:
        g.add_argument(flag, dest=field, type=kind, metavar=kind.__name__.upper(), help=text)
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop when TEXT is generated (not included); repeatable")
    g.add_argument("--ignore-eos", action="store_true", default=None,
                   help="keep generating past EOS (for benchmarks)")
    g.add_argument("--json-schema", type=_json_arg, metavar="FILE|JSON", dest="json_schema",
                   help="every row's output follows this JSON schema (a file, or the JSON itself); "
                        "a row's response_format or json_schema column overrides it")
    g.add_argument("--structured-outputs", type=_json_arg, metavar="FILE|JSON", dest="structured_outputs",
                   help='vLLM\'s structured_outputs for every row, e.g. \'{"regex": "[0-9]{4}"}\' or '
                        '\'{"choice": ["yes", "no"]}\'')


def sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    fields = [f for _, f, _, _ in _SAMPLING_FLAGS] + ["stop", "ignore_eos", "json_schema", "structured_outputs"]
    return {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}


def _json_arg(text: str) -> Any:
    """A JSON value given inline or as the path of a file holding it."""
    path = Path(text)
    try:
        source = path.read_text() if not text.lstrip().startswith(("{", "[")) and path.is_file() else text
        return json.loads(source)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"not a JSON file or JSON text: {exc}") from None


def param_columns(specs: Sequence[str]) -> dict[str, str]:
    """``["max_tokens=max_tok", "seed"]`` -> ``{"max_tokens": "max_tok", "seed": "seed"}``."""
    out = {}
    for spec in specs:
        field, _, column = spec.partition("=")
        out[field.strip()] = column.strip() or field.strip()
    return out


def _size(text: str) -> int:
    from batchgen.config import size_arg

    return size_arg(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
