"""batchgen.generate: one pandas partition in, the same rows out with generated columns.

    ddf.map_partitions(batchgen.generate, model="path/to/model", max_tokens=64, temperature=0.0)
    batchgen.generate(pdf, model="path/to/model")          # plain pandas, no cluster

Inside a Dask task the rows join this worker's engine (one per worker and model, shared by all
partitions there; see task.py). Outside Dask the rows join a process-wide engine, cached per
(model, engine options). Chat rows, output columns and hub ids: docs/guides/chat-dataframe.md.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .spec import EngineSpec

if TYPE_CHECKING:
    import pandas as pd

    from .frame import ChatOptions
    from .output_columns import Decoder, OutputColumns


def generate(pdf: pd.DataFrame, *, model: str | Path | Mapping[str, str | Path], prompt_column: str = "prompt",
             model_column: str | None = None, messages_column: str | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
             per_row: Mapping[str, str] | None = None, engine_options: Mapping[str, Any] | None = None,
             expert_memory: int | str | None = None, expert_host_memory: int | str | None = None,
             output_prefix: str = "", partition_info: Mapping[str, Any] | None = None,
             **sampling: Any) -> pd.DataFrame:
    """Generate one completion per row of `pdf`.

    model: model directory (Hugging Face layout) or Hugging Face Hub id (`org/name`,
    `org/name@revision`; each worker resolves it in its own cache, see models/hub.py).
    prompt_column: strings, or lists of token ids (on Dask, keep those as a pyarrow list column:
    dask's `dataframe.convert-string` turns Python lists in object columns into strings).
    messages_column: chat rows instead, each cell a list of {"role", "content"} messages (Python
    objects, a pyarrow `list<struct<role, content>>` column, or JSON text), rendered by the model's
    chat template with `chat_template_kwargs` (e.g. {"enable_thinking": False}) and
    `add_generation_prompt`; prompt_column is then not read. per_row: SamplingParams field ->
    column name, e.g. {"max_tokens": "max_tokens"}, {"json_schema": "schema_col"} (a JSON schema
    per row, an object or JSON text) or {"chat_template_kwargs": "col"} (a row's template
    variables over the job's); NA in such a column keeps the default. engine_options:
    EngineConfig keyword arguments (dtype, max_num_seqs, kv_cache_bytes, ...). expert_memory /
    expert_host_memory: `batchgen run`'s --expert-memory / --expert-host-memory (bytes or sizes
    like "2GiB": device and host memory for routed experts, the rest streamed from host memory
    and from the checkpoint on disk). sampling: SamplingParams fields shared by all rows, e.g.
    structured_outputs=StructuredOutputsParams(json=SCHEMA), json_schema=SCHEMA, logprobs=2.
    model_column: run each row on the model this column names; `model` is then a mapping
    name -> directory (a row naming another fails alone; see batchgen.cluster.by_model).
    output_prefix: prepended to every output column's name. partition_info: Dask's (see
    frame.py): set by map_partitions on real partitions.

    Returns `pdf` (same index, same order) plus `generated_text`, `finish_reason` ("stop" |
    "length" | "error"), `error` (NA, or a message naming the row, the field and the value),
    `num_input_tokens`, `num_generated_tokens`, `num_cached_tokens` and, when logprobs are
    asked for, `logprobs` (per token: token, logprob, top_logprobs). An input column of an
    output column's name is refused (ValueError) before any work. A bad row fails alone; a model
    that cannot load raises. Dask's meta inference call is answered with the output schema
    without loading a model.
    """
    from .frame import is_meta_partition
    from .output_columns import tokenizer_for

    job = _job(pdf, model, prompt_column, model_column, messages_column, chat_template_kwargs,
               add_generation_prompt, per_row, engine_options, expert_memory, expert_host_memory, output_prefix,
               sampling)
    if model_column is not None:
        from .by_model import run_by_model, spec_for_meta

        specs = spec_for_meta(model, job.options)  # type: ignore[arg-type]
        if len(pdf) == 0 or is_meta_partition(pdf, partition_info):
            return job.columns.placeholder(pdf)
        names = pdf[model_column].tolist()

        def decoder(i: int) -> Any:
            spec = specs.get(names[i] if isinstance(names[i], str) else str(names[i]))
            return None if spec is None else tokenizer_for(spec.model)
        return job.run(pdf, lambda reqs, rows: run_by_model(pdf.iloc[rows], model, model_column, reqs,  # type: ignore[arg-type]
                                                            job.options), decoder)
    spec = EngineSpec.make(model, job.options)  # type: ignore[arg-type]
    if is_meta_partition(pdf, partition_info):
        from .prestart import prestart

        prestart(spec)  # graph construction on the client: workers start the engine now
        return job.columns.placeholder(pdf)
    if len(pdf) == 0:
        return job.columns.placeholder(pdf)
    return job.run(pdf, lambda reqs, rows: run_requests(spec, reqs), lambda i: tokenizer_for(spec.model))


@dataclass(frozen=True, slots=True)
class _Job:
    """One call's checked arguments: what every partition of a job shares."""

    prompt_column: str
    per_row: dict[str, str]
    base: SamplingParams
    chat: ChatOptions | None
    options: dict[str, Any]
    columns: OutputColumns

    def run(self, pdf: pd.DataFrame, runner: Callable[[list[Any], list[int]], list[RequestOutput]],
            decoder: Decoder) -> pd.DataFrame:
        """Rows whose cells hold no request at all fail here; the rest run on `runner`."""
        from .frame import read_requests, split_failed

        requests = read_requests(pdf, self.prompt_column, self.per_row, self.base, self.chat)
        rows, runnable, failed = split_failed(requests)
        outputs: list[RequestOutput | None] = [None] * len(requests)
        for i, message in failed.items():
            outputs[i] = RequestOutput(i, [], [], "", "error", message)
        for i, out in zip(rows, runner(runnable, rows) if runnable else []):
            out.index = i
            outputs[i] = out
        rename = ("messages", self.chat.column) if self.chat is not None else ("prompt", self.prompt_column)
        return self.columns.frame(pdf, outputs, decoder, rename)  # type: ignore[arg-type]


def _job(pdf: pd.DataFrame, model: Any, prompt_column: str, model_column: str | None, messages_column: str | None,
         chat_template_kwargs: Mapping[str, Any] | None, add_generation_prompt: bool,
         per_row: Mapping[str, str] | None, engine_options: Mapping[str, Any] | None,
         expert_memory: int | str | None, expert_host_memory: int | str | None, output_prefix: str,
         sampling: dict[str, Any]) -> _Job:
    """Every caller error raises here, before any work (and in Dask's meta call, on the client)."""
    from .frame import ChatOptions, check_columns, with_schema
    from .output_columns import OutputColumns

    sampling = dict(sampling)
    schema = sampling.pop("json_schema", None)  # one JSON schema for the job
    base = SamplingParams(**sampling)  # an unknown field name raises TypeError here
    if schema is not None:
        base = replace(base, structured_outputs=with_schema(base.structured_outputs, schema))
    per_row = dict(per_row or {})
    chat = None if messages_column is None else ChatOptions(messages_column, chat_template_kwargs,
                                                             add_generation_prompt)
    if chat is None and chat_template_kwargs is not None:
        raise TypeError("chat_template_kwargs needs messages_column (it shapes chat prompts)")
    check_columns(pdf, prompt_column, per_row, chat)
    columns = OutputColumns.make(output_prefix, base, per_row)
    columns.check_clash(pdf.columns)
    options = _with_expert_budgets(engine_options, expert_memory, expert_host_memory)
    return _Job(prompt_column, per_row, base, chat, options, columns)


def output_meta(ddf: Any, *, model: Any = None, prompt_column: str = "prompt", model_column: str | None = None,
                messages_column: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                add_generation_prompt: bool = True, per_row: Mapping[str, str] | None = None,
                engine_options: Mapping[str, Any] | None = None, expert_memory: int | str | None = None,
                expert_host_memory: int | str | None = None, output_prefix: str = "", **sampling: Any
                ) -> pd.DataFrame:
    """The empty frame `generate` returns for `ddf` (a Dask or pandas DataFrame) with these
    arguments: `ddf.map_partitions(batchgen.generate, ..., meta=batchgen.output_meta(ddf, ...))`
    makes no inference call. Checks the arguments as `generate` does; loads no model."""
    empty = getattr(ddf, "_meta", ddf).iloc[:0]
    job = _job(empty, model, prompt_column, model_column, messages_column, chat_template_kwargs,
               add_generation_prompt, per_row, engine_options, expert_memory, expert_host_memory, output_prefix,
               sampling)
    return job.columns.placeholder(empty)


def _with_expert_budgets(options: Mapping[str, Any] | None, device: int | str | None,
                         host: int | str | None) -> dict[str, Any]:
    """engine_options plus the expert budgets, checked and in bytes (one spec per real config:
    "2GiB" and 2147483648 share an engine)."""
    from ..config import BYTE_FIELDS, parse_size

    def size(name: str, value: Any) -> Any:
        return parse_size(value, name) if isinstance(value, str) else value

    merged = {name: size(name, value) if name in BYTE_FIELDS else value for name, value in (options or {}).items()}
    for name, value in (("expert_memory_bytes", device), ("expert_host_memory_bytes", host)):
        if value is not None:
            value = size(name, value)
            if name in merged and merged[name] != value:
                raise TypeError(f"{name} given twice (engine_options and keyword) with different values")
            merged[name] = value
    return merged


def run_requests(spec: EngineSpec, requests: list[tuple[Any, Any]]) -> list[RequestOutput]:
    """Run (prompt, SamplingParams) pairs on this worker's engine for `spec` (or the process's
    own, outside Dask); outputs in input order. Inside a task, the thread slot is released
    while waiting."""
    from .task import this_host, wait_for

    host = this_host()
    job = host.open_job(spec, requests)
    try:
        wait_for([job])
        host.timeline.rows_back()
        return job.result()
    finally:
        host.close_job(job)


def generate_rows(requests: list[tuple[Any, Any]], *, spec: Mapping[str, Any]) -> list[Any]:
    """The Dask task of file jobs on a cluster (`batchgen run --scheduler/--workers`, multi-model
    pools): (request, params) pairs in, outputs out, in order, on this worker's engine for `spec`
    (an EngineSpec message: any engine class, text or image)."""
    return run_requests(EngineSpec.from_msg(spec), requests)
