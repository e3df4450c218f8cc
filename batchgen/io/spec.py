"""A file job's settings, the checks that must pass before any work, and opening its files.

Input and output are fsspec URLs or local paths (io/storage.py). The input's format follows its
name (``.jsonl``, optionally compressed: OpenAI batch; ``.parquet``), or, for a directory, its
files. The output's follows its name: ``.jsonl`` (a JSONL input's only), ``.parquet`` (one
file), anything else a Parquet dataset directory (io/parquet_sink.py). ``check`` raises
``BatchgenError`` with one clear message for anything that would make the whole job fail, so
the CLI can stop (exit 2) before loading a model and before writing anything. ``open`` opens a
text job's reader and sink; another kind of job opens its own after ``prepare_output``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import dask.config

from batchgen.errors import BatchgenError
from batchgen.io.fingerprint import check_resume, job_record, record
from batchgen.io.jsonl_sink import JsonlPartsSink, JsonlSink
from batchgen.io.openai_batch import OpenAIBatchReader
from batchgen.io.parquet import ParquetReader, check_columns, output_columns, read_schema
from batchgen.io.parquet_sink import ParquetSink
from batchgen.io.rows import RowContext
from batchgen.io.sink import SplitSink
from batchgen.io.source import Source
from batchgen.io.storage import Location, describe_failure, locate
from batchgen.io.structured import StructuredFieldError, resolve
from batchgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchgen.io.sink import Sink

log = logging.getLogger("batchgen")
Format = Literal["jsonl", "parquet"]
FORMATS: dict[str, Format] = {".jsonl": "jsonl", ".parquet": "parquet"}
OutputKind = Literal["jsonl", "parquet", "dataset"]
BUCKETS = ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "az")  # filesystems whose first path part is a bucket


@dataclass(frozen=True, slots=True)
class Formats:
    """The extensions a kind of job reads and writes."""

    inputs: tuple[str, ...] = tuple(FORMATS)
    outputs: tuple[str, ...] = ()  # empty: a text job's (the input's, or Parquet for JSONL input)
    job: str = "a text job"  # names the kind in messages
    datasets: bool = True  # may write a Parquet dataset directory
    remote: bool = True  # may read and write object storage


TEXT_FORMATS = Formats()


def output_kind(output: str | Path) -> OutputKind:
    text = str(output)
    if text.endswith("/"):
        return "dataset"
    name = text.rsplit("/", 1)[-1].lower()
    return "jsonl" if name.endswith(".jsonl") else "parquet" if name.endswith(".parquet") else "dataset"


@dataclass(frozen=True, slots=True)
class JobSpec:
    input: str | Path
    output: str | Path
    resume: bool = False
    overwrite: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs
    # Parquet only
    prompt_column: str = "prompt"
    id_column: str | None = None
    param_columns: dict[str, str] = field(default_factory=dict)  # field -> column
    per_row_params: bool = False
    formats: Formats = TEXT_FORMATS
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec's, over dask.config's
    retry_errors: bool = False  # with resume: rows that ended in a retryable error run again
    force_resume: bool = False  # resume even though what decides the outputs changed
    error_file: str | Path | None = None  # failed rows go here instead of the output
    # what else decides the outputs: {"models": {name: identity}, "options": {...}} (the CLI's)
    job: dict[str, Any] = field(default_factory=dict)
    _state: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def source(self) -> Source:
        if "source" not in self._state:
            self._state["source"] = Source.open(self.input, self.storage_options, self.formats.inputs)
        return self._state["source"]

    @property
    def out(self) -> Location:
        if "out" not in self._state:
            self._state["out"] = locate(self.output, self.storage_options, flag="--output")
        return self._state["out"]

    @property
    def errors_at(self) -> Location | None:
        if self.error_file is None:
            return None
        if "errors" not in self._state:
            self._state["errors"] = locate(self.error_file, self.storage_options, flag="--error-file")
        return self._state["errors"]

    @property
    def format(self) -> Format:
        return self.source.format

    @property
    def output_format(self) -> Format:
        return "jsonl" if self.output_kind == "jsonl" else "parquet"

    @property
    def output_kind(self) -> OutputKind:
        return output_kind(self.output)

    @property
    def dataset(self) -> bool:
        return self.output_kind == "dataset"

    def check(self) -> None:
        """Everything that can be known wrong before the model is loaded."""
        if self.resume and self.overwrite:
            raise BatchgenError("--resume and --overwrite contradict each other; pick one")
        if self.retry_errors and not self.resume:
            raise BatchgenError("--retry-errors reruns failed rows of an existing output: it needs --resume")
        source = self.source  # exit 2: missing file, bucket, credentials or extra; a format not read
        self._check_formats()
        source.check_readable()
        for loc, flag in ((self.out, "--output"), (self.errors_at, "--error-file")):
            if loc is None:
                continue
            if not self.formats.remote and not loc.is_local:
                raise BatchgenError(f"{flag} {loc.url}: {self.formats.job} writes local files only")
            if source.same_as(loc):
                raise BatchgenError(f"{flag} must not be the input")
            _check_writable_root(loc, flag)
        if self._output_exists() and not (self.resume or self.overwrite):
            raise BatchgenError(f"--output {self.output} already exists: pass --resume to "
                                "finish it or --overwrite to start over")
        try:
            problem = SamplingParams.from_mapping(resolve(self.defaults)).validate()
        except StructuredFieldError as exc:
            problem = exc.error.message
        if problem:
            raise BatchgenError(f"bad default sampling flag: {problem}")
        if self.format == "parquet":
            schema = read_schema(source)
            check_columns(source, schema.names, self.prompt_column, self.id_column, self.param_columns)
        if self.resume and self._output_exists():
            for change in check_resume(self.out, self.dataset, self.fingerprint(), self.force_resume):
                log.warning("--force-resume: finishing %s although %s", self.output, change)

    def _check_formats(self) -> None:
        kind, fmt, out = self.formats.job, self.source.format, self.output_kind
        if self.formats.outputs:
            allowed = self.formats.outputs
            if out == "dataset" or not any(str(self.output).lower().endswith(s) for s in allowed):
                raise BatchgenError(f"--output {self.output}: {kind} writes {' or '.join(allowed)} files")
        elif fmt == "parquet" and out == "jsonl":
            raise BatchgenError(f"--output {self.output}: a Parquet input's rows are written as Parquet "
                                "(name the output .parquet, or a directory for a dataset)")
        if str(self.output).lower().rsplit("/", 1)[-1].endswith((".gz", ".bz2", ".zst", ".xz")):
            raise BatchgenError(f"--output {self.output}: compressed JSONL output is not written; use .jsonl "
                                "or a Parquet output (compressed per column)")
        if self.error_file is not None:
            ekind = output_kind(self.error_file)
            if fmt == "parquet" and ekind == "jsonl":
                raise BatchgenError(f"--error-file {self.error_file}: a Parquet input's failed rows are written "
                                    "as Parquet (name it .parquet, or a directory)")

    def fingerprint(self) -> dict[str, Any]:
        """What decides the outputs now (io/fingerprint.py); the input's digest is read once."""
        if "fingerprint" not in self._state:
            log.debug("digesting the input %s", self.input)
            options = {"sampling": resolve_for_record(self.defaults), "prompt_column": self.prompt_column,
                       "id_column": self.id_column, "param_columns": self.param_columns,
                       "per_row_params": self.per_row_params, **self.job.get("options", {})}
            self._state["fingerprint"] = job_record(self.source.digest(), self.source.loc.url,
                                                    self.job.get("models", {}), options)
        return self._state["fingerprint"]

    def prepare_output(self) -> None:
        """Make way for the output (``--overwrite`` removes the old one) and record what it is
        made from, for a later ``--resume``; call ``check`` first."""
        for loc in (self.out, self.errors_at):
            if loc is not None and loc.is_local:
                Path(loc.path).parent.mkdir(parents=True, exist_ok=True)
        if self.overwrite:
            for loc in (self.out, self.errors_at):
                if loc is not None:
                    _remove_output(loc)
        if not (self.resume and self._output_exists()):
            record(self.out, self.dataset, self.fingerprint())

    def open(self, ctx: RowContext, *, model: str, contexts: dict[str, RowContext] | None = None) -> tuple[
            OpenAIBatchReader | ParquetReader, Sink]:
        """A text job's reader and (resumed or fresh) sink; call ``check`` first."""
        self.prepare_output()
        resume = self.resume
        if self.format == "jsonl":
            reader: OpenAIBatchReader | ParquetReader = OpenAIBatchReader(self.source, ctx, contexts)
            schema = None
        else:
            reader = ParquetReader(self.source, ctx, prompt_column=self.prompt_column, id_column=self.id_column,
                                   param_columns=self.param_columns, per_row_params=self.per_row_params)
            schema = reader.schema
        sink = self._sink(self.out, self.output_kind, schema, ctx, model, resume, self.asks_logprobs(schema))
        # rows per part/flush: dask.config batchgen.file-job-flush-rows (smaller: finer resume points)
        sink.flush_rows = int(dask.config.get("batchgen.file-job-flush-rows", default=None) or sink.flush_rows)
        if self.errors_at is not None:
            errors = self._sink(self.errors_at, output_kind(self.error_file or ""), schema, ctx, model, resume,
                                False)
            sink = SplitSink(sink, errors)
        return reader, sink

    def asks_logprobs(self, schema: Any) -> bool:
        """Whether the Parquet output gets a logprobs column: a JSONL row may always ask."""
        if schema is None or self.defaults.get("logprobs") is not None or "logprobs" in self.param_columns:
            return True
        return self.per_row_params and "logprobs" in schema.names

    def _sink(self, loc: Location, kind: OutputKind, schema: Any, ctx: RowContext, model: str, resume: bool,
              logprobs: bool) -> Sink:
        retry = self.retry_errors
        if kind == "jsonl":
            if loc.is_local:
                return JsonlSink(loc.local_path(), model=model, resume=resume, tokenizer=ctx.tokenizer, retry=retry)
            return JsonlPartsSink(loc, model=model, resume=resume, tokenizer=ctx.tokenizer, retry=retry)
        import pyarrow as pa

        return ParquetSink(loc, schema if schema is not None else pa.schema([]), resume=resume,
                           columns=output_columns(logprobs), dataset=kind == "dataset", retry=retry,
                           tokenizer=ctx.tokenizer, jsonl_input=schema is None)

    def _output_exists(self) -> bool:
        return any(loc is not None and _exists(loc) for loc in (self.out, self.errors_at))


def resolve_for_record(defaults: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults as the sidecar records them (JSON values, sorted)."""
    return {k: defaults[k] for k in sorted(defaults)}


def _exists(loc: Location) -> bool:
    try:
        return loc.exists() or loc.fs.exists(loc.path + ".parts")
    except Exception as exc:  # noqa: BLE001 - each filesystem's own errors: one message, exit 2
        raise describe_failure("--output", loc.url, exc) from None


def _remove_output(loc: Location) -> None:
    for path in (loc.path, loc.path + ".parts", loc.path + ".input.json"):
        if loc.fs.exists(path):
            loc.fs.rm(path, recursive=True)


def _check_writable_root(loc: Location, flag: str) -> None:
    """An object store's bucket (container) must exist: fail before any work, write nothing."""
    protocols = {loc.fs.protocol} if isinstance(loc.fs.protocol, str) else set(loc.fs.protocol)
    if not protocols & set(BUCKETS):
        return
    bucket = loc.path.lstrip("/").split("/", 1)[0]
    try:
        found = loc.fs.exists(bucket)
    except Exception as exc:  # noqa: BLE001
        raise describe_failure(flag, loc.url, exc) from None
    if not found:
        raise BatchgenError(f"{flag} {loc.url}: no such bucket {bucket!r}")
