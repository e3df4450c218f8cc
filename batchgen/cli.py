"""``batchgen run`` (a file job) and ``batchgen demo`` (the same on a bundled file and model);
``batchgen plan`` and ``batchgen bench`` come from batchgen/sim/cli.py.

Exit codes (batchgen/io/report.py, docs/guides/file-jobs.md): 0 when the job completed with
failed rows within ``--max-error-rate``; 3 when more rows failed (a job whose rows all failed
never exits 0); 1 when the engine or cluster failed mid-job; 2 when it could not start (bad
flags, unreadable input, missing model, bucket, credentials or filesystem extra, an output that
exists without --resume/--overwrite, a resume of another job); 130 when interrupted (what
finished is kept: rerun with --resume).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.errors import BatchgenError

if TYPE_CHECKING:
    from distributed import Client

    from batchgen.io.job import JobSummary
    from batchgen.io.spec import JobSpec

log = logging.getLogger("batchgen")

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


def setup_logging(args: argparse.Namespace) -> None:
    """The ``batchgen`` logger to stderr; the progress bar stays tqdm's."""
    level = getattr(args, "log_level", None)
    if level is None:
        verbose, quiet = getattr(args, "verbose", None) or 0, getattr(args, "quiet", None) or 0
        level = "DEBUG" if verbose > 0 else "ERROR" if quiet > 0 else "INFO"
    logger = logging.getLogger("batchgen")
    logger.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("batchgen: %(message)s"))
        logger.addHandler(handler)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (tests and notebooks swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


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


def main(argv: Sequence[str] | None = None) -> int:
    from batchgen.io.faults import JobAborted
    from batchgen.io.report import EXIT_ABORTED, EXIT_CANNOT_START, EXIT_INTERRUPTED

    args = build_parser().parse_args(argv)
    setup_logging(args)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command in ("plan", "bench", "moa"):
            return args.handler(args)
        if args.command == "report":
            return _report_command(args)
        return _run(args)
    except JobAborted as exc:
        print(f"batchgen: error: {exc}; rerun with --resume --retry-errors to finish", file=sys.stderr)
        _report(args, getattr(exc, "summary", None), EXIT_ABORTED)
        return EXIT_ABORTED
    except BatchgenError as exc:
        print(f"batchgen: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    except KeyboardInterrupt:
        print("batchgen: interrupted; finished rows are saved: rerun with --resume to finish",
              file=sys.stderr)
        _report(args, None, EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED


def _job_spec(args: argparse.Namespace, **kw: Any) -> JobSpec:
    """The run command's JobSpec, with what decides its outputs for ``--resume`` (the models'
    identities, the options that change tokens)."""
    from batchgen.io.fingerprint import model_identity
    from batchgen.io.report import check_rate
    from batchgen.io.spec import JobSpec
    from batchgen.io.storage import parse_storage_options

    check_rate(args.max_error_rate)
    if args.models:
        from batchgen.moa.backend import parse_models

        models = {name: model_identity(path) for name, path in parse_models(args.models).items()}
    else:
        models = {"model": model_identity(args.model)}
    options = {"dtype": args.dtype or "auto"}
    return JobSpec(input=args.input, output=args.output, resume=args.resume, overwrite=args.overwrite,
                   storage_options=parse_storage_options(args.storage_option), retry_errors=args.retry_errors,
                   force_resume=args.force_resume, error_file=args.error_file,
                   job={"models": models, "options": options}, **kw)


def _report(args: argparse.Namespace, summary: JobSummary | None, code: int) -> None:
    """The summary as the last stderr line, and in --summary-json."""
    if getattr(args, "command", None) != "run":
        return
    from batchgen.io.report import summary_record, write_summary
    from batchgen.io.storage import parse_storage_options

    record = summary_record(summary, code, input_url=str(args.input), output_url=str(args.output),
                            error_file=args.error_file, max_error_rate=args.max_error_rate)
    if args.summary_json:
        try:
            write_summary(args.summary_json, record, parse_storage_options(args.storage_option))
        except (OSError, BatchgenError) as exc:
            print(f"batchgen: could not write --summary-json {args.summary_json}: {exc}", file=sys.stderr)
    print(json.dumps(record), file=sys.stderr)


def _finish(args: argparse.Namespace, spec: JobSpec, summary: JobSummary, where: str = "") -> int:
    from batchgen.io.report import EXIT_TOO_MANY_ERRORS, exit_code

    code = exit_code(summary, args.max_error_rate)
    log.info("wrote %s: %s%s", spec.output, summary.describe(), where)
    if code == EXIT_TOO_MANY_ERRORS:
        counts = summary.request_counts()
        log.error("%d of %d rows failed, more than --max-error-rate %s allows: exit %d", counts["failed"],
                  counts["total"], args.max_error_rate, code)
    _report(args, summary, code)
    return code


def _check_report(args: argparse.Namespace) -> None:
    """--report's needs, before any work: a cluster (the charts are its plugin's) and bokeh."""
    if not getattr(args, "report", None):
        return
    if not (args.scheduler or args.workers):
        raise BatchgenError("--report needs --workers or --scheduler: the charts come from the cluster's "
                            "batchgen plugin")
    import importlib.util

    if importlib.util.find_spec("bokeh") is None:
        raise BatchgenError("--report needs bokeh: pip install 'batchgen[dashboard]'")


def _write_report(path: str, client: Client) -> None:
    """The job's charts, once it has finished and before its cluster goes; a failure here is
    reported and leaves the job's own outcome as it is."""
    from batchgen.cluster.html_report import report

    try:
        log.info("wrote the job's charts to %s", report(path, client))
    except Exception as exc:  # noqa: BLE001 - the output is complete either way
        log.error("could not write --report %s (%s: %s); the results are complete", path, type(exc).__name__, exc)


def _report_command(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("bokeh") is None:
        raise BatchgenError("batchgen report needs bokeh: pip install 'batchgen[dashboard]'")
    from distributed import Client

    from batchgen.cluster.client import is_installed
    from batchgen.cluster.html_report import report

    try:
        client = Client(args.scheduler, timeout="10s")
    except OSError as exc:
        raise BatchgenError(f"cannot reach the scheduler at {args.scheduler}: {exc}") from None
    try:
        if not is_installed(client):
            raise BatchgenError(f"the cluster at {args.scheduler} runs no batchgen plugin: nothing to report")
        log.info("wrote %s", report(args.output, client))
    finally:
        client.close()
    return 0


def _run(args: argparse.Namespace) -> int:
    _check_report(args)
    if args.model and (Path(args.model) / "model_index.json").is_file():  # a diffusers pipeline: image generation
        return _run_images(args)

    spec = _job_spec(args, defaults=sampling_defaults(args), prompt_column=args.prompt_column,
                     id_column=args.id_column, param_columns=param_columns(args.param_column),
                     per_row_params=args.per_row_params)
    spec.check()
    if args.models:
        return _run_models(spec, args)
    summary = _execute(spec, args.model, args)
    return _finish(args, spec, summary)


def _run_images(args: argparse.Namespace) -> int:
    """An image job: a text job's checks and runner with the image reader, sink and backend
    (batchgen/diffusion/images_batch.py), in this process or on a Dask cluster."""
    from batchgen.diffusion.engine_spec import image_spec
    from batchgen.diffusion.images_batch import IMAGE_FORMATS, cluster_stream, engine_stream, run_images_job
    from batchgen.diffusion.pipeline import read_index

    spec = _job_spec(args, formats=IMAGE_FORMATS)
    spec.check()
    options = {"dtype": args.dtype or "auto", "device": args.device, "max_image_tokens": args.max_image_tokens}
    name = Path(args.model).name
    if args.scheduler or args.workers:
        from batchgen.io.dask_backend import DaskBackend

        read_index(args.model)  # not a supported pipeline: exit 2 before any work (weights load on the workers)
        engine = image_spec(args.model, options)
        with _cluster(args, engine.key) as client:
            summary = run_images_job(spec, cluster_stream(DaskBackend(client, engine)), model_name=name,
                                     chunk_size=args.chunk_size, progress=args.progress)
    else:
        from batchgen.diffusion.engine import DiffusionEngine

        local = DiffusionEngine(args.model, **options)  # ModelLoadError: exit 2
        summary = run_images_job(spec, engine_stream(local), model_name=name, chunk_size=args.chunk_size,
                                 progress=args.progress)
    return _finish(args, spec, summary)


def _run_models(spec: JobSpec, args: argparse.Namespace) -> int:
    from batchgen.moa.backend import parse_models, run_models_file_job

    models = parse_models(args.models)
    client = cluster = None
    if args.scheduler or args.workers:
        from distributed import Client

        from batchgen.cluster.client import install, local_cluster

        cluster = None if args.scheduler else local_cluster(args.workers)
        client = Client(args.scheduler) if args.scheduler else Client(cluster)
        install(client)
    try:
        summary, placement = run_models_file_job(spec, models, client=client, placement=args.placement,
                                                 engine_options=engine_options(args), chunk_size=args.chunk_size,
                                                 progress=args.progress)
        if client is not None and getattr(args, "report", None):
            _write_report(args.report, client)
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
    where = f"; placement {placement.describe()}" if placement is not None else ""
    return _finish(args, spec, summary, where)


def _execute(spec: JobSpec, model: str | Path, args: argparse.Namespace) -> JobSummary:
    from batchgen.io.job import run_file_job

    if getattr(args, "scheduler", None) or getattr(args, "workers", None):
        return _execute_on_cluster(spec, model, args)
    from batchgen.engine import Engine

    engine = Engine(model, **engine_options(args))  # ModelLoadError: exit 2
    try:
        return run_file_job(spec, engine, chunk_size=args.chunk_size, progress=args.progress)
    finally:
        engine.close()


def _execute_on_cluster(spec: JobSpec, model: str | Path, args: argparse.Namespace) -> JobSummary:
    """The driver reads config and tokenizer only; the weights load on the workers."""
    from batchgen.cluster.spec import EngineSpec
    from batchgen.io.dask_backend import DaskBackend
    from batchgen.io.job import run_file_job
    from batchgen.models.info import ModelInfo

    info = ModelInfo.load(model)  # ModelLoadError / UnsupportedModelError: exit 2, before any work
    engine = EngineSpec.make(model, engine_options(args))
    with _cluster(args, engine.key) as client:
        return run_file_job(spec, info, chunk_size=args.chunk_size, progress=args.progress,
                            backend=DaskBackend(client, engine))


@contextlib.contextmanager
def _cluster(args: argparse.Namespace, engine_key: str) -> Iterator[Client]:
    """A client of --scheduler's cluster, or of a local one of --workers workers (closed after),
    with batchgen installed; a user's cluster is left as it was found."""
    from distributed import Client

    from batchgen.cluster.client import install, local_cluster

    cluster = None if args.scheduler else local_cluster(args.workers)
    try:
        client = Client(args.scheduler) if args.scheduler else Client(cluster)
        try:
            ours = install(client)  # False: the cluster already runs batchgen for someone else too
            try:
                yield client
                if getattr(args, "report", None):
                    _write_report(args.report, client)
            finally:
                if args.scheduler:
                    _leave_as_found(client, ours, engine_key)
        finally:
            client.close()
    finally:
        if cluster is not None:
            cluster.close()


def _leave_as_found(client: Client, ours: bool, engine_key: str) -> None:
    """Undo what this run added to a user's cluster: the plugin if it installed it (which stops
    its engines too), else the idle engines of this run's model. A failure here is reported,
    never allowed to hide the job's own outcome (the output file is complete either way)."""
    from batchgen.cluster.client import disconnect, release

    try:
        if ours:
            disconnect(client)
        else:
            release(client, engine_key)
    except Exception as exc:  # noqa: BLE001
        print(f"batchgen: could not clean up the cluster ({type(exc).__name__}: {exc}); "
              "the results are complete", file=sys.stderr)


def _demo(args: argparse.Namespace) -> int:
    from batchgen.demo.run import run_demo

    return run_demo(args, _execute)


def _size(text: str) -> int:
    from batchgen.config import size_arg

    return size_arg(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
