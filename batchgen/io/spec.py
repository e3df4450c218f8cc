"""A file job's settings, the checks that must pass before any work, and opening its files.

The format follows the extension (``.jsonl``: OpenAI batch; ``.parquet``); a text job's output
must use its input's, another kind of job says what it reads and writes (``formats``). ``check``
raises ``BatchgenError`` with one clear message for anything that would make the whole job fail,
so the CLI can stop before loading a model. ``open`` opens a text job's reader and sink; another
kind of job opens its own after ``prepare_output``.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from batchgen.errors import BatchgenError
from batchgen.io.fingerprint import check_resume, record
from batchgen.io.jsonl_sink import JsonlSink
from batchgen.io.openai_batch import OpenAIBatchReader
from batchgen.io.parquet import ParquetReader, check_columns, read_schema
from batchgen.io.parquet_sink import ParquetSink, parts_dir
from batchgen.io.rows import RowContext
from batchgen.io.structured import StructuredFieldError, resolve
from batchgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchgen.io.sink import Sink

Format = Literal["jsonl", "parquet"]
FORMATS: dict[str, Format] = {".jsonl": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True, slots=True)
class Formats:
    """The extensions a kind of job reads and writes."""

    inputs: tuple[str, ...] = tuple(FORMATS)
    outputs: tuple[str, ...] = ()  # empty: the input's own (a text job writes the format it reads)
    job: str = "a text job"  # names the kind in messages


TEXT_FORMATS = Formats()


@dataclass(frozen=True, slots=True)
class JobSpec:
    input: Path
    output: Path
    resume: bool = False
    overwrite: bool = False
    defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs
    # Parquet only
    prompt_column: str = "prompt"
    id_column: str | None = None
    param_columns: dict[str, str] = field(default_factory=dict)  # field -> column
    per_row_params: bool = False
    formats: Formats = TEXT_FORMATS

    @property
    def format(self) -> Format:
        return FORMATS[self.input.suffix.lower()]

    @property
    def output_format(self) -> Format:
        return FORMATS[self.output.suffix.lower()]

    def check(self) -> None:
        """Everything that can be known wrong before the model is loaded."""
        self._check_extensions()
        if not self.input.is_file():
            raise BatchgenError(f"--input {self.input}: no such file")
        try:
            with open(self.input, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise BatchgenError(f"--input {self.input}: cannot read it: {exc}") from None
        if self.output.resolve() == self.input.resolve():
            raise BatchgenError("--output must not be the input file")
        if self.resume and self.overwrite:
            raise BatchgenError("--resume and --overwrite contradict each other; pick one")
        if self._output_exists() and not (self.resume or self.overwrite):
            raise BatchgenError(f"--output {self.output} already exists: pass --resume to "
                                "finish it or --overwrite to start over")
        if self.resume and self._output_exists():
            check_resume(self.input, self.output)
        try:
            problem = SamplingParams.from_mapping(resolve(self.defaults)).validate()
        except StructuredFieldError as exc:
            problem = exc.error.message
        if problem:
            raise BatchgenError(f"bad default sampling flag: {problem}")
        if self.format == "parquet":
            schema = read_schema(self.input)
            check_columns(self.input, schema.names, self.prompt_column, self.id_column,
                          self.param_columns)

    def _check_extensions(self) -> None:
        kind, suffix = self.formats.job, self.input.suffix.lower()
        if suffix not in self.formats.inputs:
            raise BatchgenError(f"--input {self.input}: {kind} reads {' or '.join(self.formats.inputs)} "
                                f"files; its extension is {self.input.suffix!r}")
        if self.output.suffix.lower() not in (self.formats.outputs or (suffix,)):
            why = (f"{kind} writes {' or '.join(self.formats.outputs)} files" if self.formats.outputs else
                   f"must be {self.input.suffix} like the input (the output format follows the input's)")
            raise BatchgenError(f"--output {self.output}: {why}")

    def prepare_output(self) -> None:
        """Make way for the output (``--overwrite`` removes the old one) and record which input
        it is made from, for a later ``--resume``; call ``check`` first."""
        self.output.parent.mkdir(parents=True, exist_ok=True)
        if self.overwrite:
            self.output.unlink(missing_ok=True)
            shutil.rmtree(parts_dir(self.output), ignore_errors=True)
        if not (self.resume and self._output_exists()):
            record(self.input, self.output)

    def open(self, ctx: RowContext, *, model: str, contexts: dict[str, RowContext] | None = None) -> tuple[
            OpenAIBatchReader | ParquetReader, Sink]:
        """A text job's reader and (resumed or fresh) sink; call ``check`` first."""
        self.prepare_output()
        if self.format == "jsonl":
            return (OpenAIBatchReader(self.input, ctx, contexts),
                    JsonlSink(self.output, model=model, resume=self.resume,
                              tokenizer=ctx.tokenizer))
        reader = ParquetReader(self.input, ctx, prompt_column=self.prompt_column,
                               id_column=self.id_column, param_columns=self.param_columns,
                               per_row_params=self.per_row_params)
        return reader, ParquetSink(self.output, reader.schema, resume=self.resume)

    def _output_exists(self) -> bool:
        return self.output.exists() or parts_dir(self.output).exists()
