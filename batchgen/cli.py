"""``batchgen run`` (a file job) and ``batchgen demo`` (the same on a bundled file and model);
``batchgen plan`` and ``batchgen bench`` come from batchgen/sim/cli.py.

Exit codes: 0 when the job ran to the end, even if some rows failed (their error records say
why; the summary counts them); 2 when it could not start (bad flags, unreadable input, missing
model, an output that exists without --resume/--overwrite); 130 when interrupted (what finished
is kept: rerun with --resume).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.errors import BatchgenError

if TYPE_CHECKING:
    from distributed import Client

    from batchgen.io.job import JobSummary
    from batchgen.io.spec import JobSpec

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
    parser = argparse.ArgumentParser(
        prog="batchgen", description="Batch (offline) inference of Mixture-of-Experts LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run", help="run a JSONL or Parquet file of requests through a model",
        description="Run every row of --input through the model and write one result or error "
        "per row to --output. Input by extension: .jsonl (OpenAI batch: custom_id, method, url "
        "/v1/completions or /v1/chat/completions, body) or .parquet (one prompt per row; all "
        "columns pass through). The output uses the input's format. Rows with bad values get "
        "an error record and the job goes on; exit code 2 means it could not start.")
    which = run.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="model directory "
                       "(config.json, *.safetensors, tokenizer.json)")
    which.add_argument("--models", nargs="+", metavar="NAME=DIR", help="several models (or one models.toml / models.yaml): "
                       "each JSONL line runs on the model its body.model names (batchgen/moa/backend.py)")
    run.add_argument("--placement", choices=["ilp", "round_robin", "data_parallel"], default="ilp",
                     help="with --models on a cluster: how models and rows are placed on workers (default: ilp)")
    run.add_argument("--input", required=True, type=Path, metavar="FILE",
                     help="requests: .jsonl (OpenAI batch) or .parquet")
    run.add_argument("--output", required=True, type=Path, metavar="FILE",
                     help="results, same extension as --input (an image job's: .jsonl or .parquet); "
                          "written as rows finish")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue an interrupted job: "
                       "skip rows already in --output, run the rest")
    again.add_argument("--overwrite", action="store_true", help="replace an existing --output")
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
    from batchgen.sim.cli import add_commands as add_sim_commands

    add_sim_commands(sub)  # plan, bench: the simulator's commands, self-contained in sim/cli.py
    from batchgen.moa.cli import add_command as add_moa_command

    add_moa_command(sub)  # moa: batchgen/moa/cli.py
    return parser


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
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command in ("plan", "bench", "moa"):
            return args.handler(args)
        return _run(args)
    except BatchgenError as exc:
        print(f"batchgen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("batchgen: interrupted; finished rows are saved: rerun with --resume to finish",
              file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from batchgen.io.spec import JobSpec

    if args.model and (Path(args.model) / "model_index.json").is_file():  # a diffusers pipeline: image generation
        return _run_images(args)

    spec = JobSpec(input=args.input, output=args.output, resume=args.resume,
                   overwrite=args.overwrite, defaults=sampling_defaults(args),
                   prompt_column=args.prompt_column, id_column=args.id_column,
                   param_columns=param_columns(args.param_column),
                   per_row_params=args.per_row_params)
    spec.check()
    if args.models:
        return _run_models(spec, args)
    summary = _execute(spec, args.model, args)
    print(f"batchgen: wrote {spec.output}: {summary.describe()}", file=sys.stderr)
    return 0


def _run_images(args: argparse.Namespace) -> int:
    """An image job: a text job's checks and runner with the image reader, sink and backend
    (batchgen/diffusion/images_batch.py), in this process or on a Dask cluster."""
    from batchgen.diffusion.engine_spec import image_spec
    from batchgen.diffusion.images_batch import IMAGE_FORMATS, cluster_stream, engine_stream, run_images_job
    from batchgen.diffusion.pipeline import read_index
    from batchgen.io.spec import JobSpec

    spec = JobSpec(input=args.input, output=args.output, resume=args.resume, overwrite=args.overwrite,
                   formats=IMAGE_FORMATS)
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
    print(f"batchgen: wrote {spec.output}: {summary.describe()}", file=sys.stderr)
    return 0


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
    finally:
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
    where = f"; placement {placement.describe()}" if placement is not None else ""
    print(f"batchgen: wrote {spec.output}: {summary.describe()}{where}", file=sys.stderr)
    return 0


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
    from batchgen.config import parse_size

    try:
        return parse_size(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
