"""batchgen.generate: one pandas partition in, the same rows out with generated columns.

    ddf.map_partitions(batchgen.generate, model="path/to/model", max_tokens=64, temperature=0.0)
    batchgen.generate(pdf, model="path/to/model")          # plain pandas, no cluster

Inside a Dask task the rows join this worker's engine (one per worker and model, shared by all
partitions there; see task.py). Outside Dask the rows join a process-wide engine, cached per
(model, engine options). dask, distributed and pandas are imported on first call only:
`import batchgen` stays light.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from ..outputs import RequestOutput
    from .spec import EngineSpec


def generate(pdf: pd.DataFrame, *, model: str | Path | Mapping[str, str | Path], prompt_column: str = "prompt",
             model_column: str | None = None,
             per_row: Mapping[str, str] | None = None, engine_options: Mapping[str, Any] | None = None,
             expert_memory: int | str | None = None, expert_host_memory: int | str | None = None,
             **sampling: Any) -> pd.DataFrame:
    """Generate one completion per row of `pdf`.

    model: model directory (Hugging Face layout). prompt_column: strings, or lists of token ids
    (on Dask, keep those as a pyarrow list column: dask's `dataframe.convert-string` turns
    Python lists in object columns into strings). per_row: SamplingParams field -> column name,
    e.g. {"max_tokens": "max_tokens"}, or {"json_schema": "schema_col"} (a JSON schema per row,
    an object or JSON text); NA in such a column keeps the default. engine_options:
    EngineConfig keyword arguments (dtype, max_num_seqs, kv_cache_bytes, ...). expert_memory /
    expert_host_memory: `batchgen run`'s --expert-memory / --expert-host-memory (bytes or sizes
    like "2GiB": device and host memory for routed experts, the rest streamed from host memory
    and from the checkpoint on disk). sampling: SamplingParams fields shared by all rows, e.g.
    structured_outputs=StructuredOutputsParams(json=SCHEMA), or json_schema=SCHEMA.
    model_column: run each row on the model this column names; `model` is then a mapping
    name -> directory (a row naming another fails alone; see batchgen.cluster.by_model).

    Returns `pdf` (same index, same order) plus `generated_text`, `num_generated_tokens`,
    `finish_reason` ("stop" | "length" | "error") and `error` (NA, or a message naming the row,
    the field and the value). A bad row fails alone; a model that cannot load raises.
    Dask's meta inference call is answered with the output schema without loading a model.
    """
    from ..sampling_params import SamplingParams
    from .frame import check_columns, is_meta_call, output_frame, placeholder_output, read_requests
    from .spec import EngineSpec

    schema = sampling.pop("json_schema", None)  # one JSON schema for the job
    base = SamplingParams(**sampling)  # an unknown field name raises TypeError here
    if schema is not None:
        from dataclasses import replace

        from .frame import with_schema

        base = replace(base, structured_outputs=with_schema(base.structured_outputs, schema))
    per_row = dict(per_row or {})
    check_columns(pdf, prompt_column, per_row)
    options = _with_expert_budgets(engine_options, expert_memory, expert_host_memory)
    if model_column is not None:
        from .by_model import run_by_model, spec_for_meta

        spec_for_meta(model, options)  # type: ignore[arg-type]
        if len(pdf) == 0 or is_meta_call():
            return placeholder_output(pdf)
        requests = read_requests(pdf, prompt_column, per_row, base)
        return output_frame(pdf, run_by_model(pdf, model, model_column, requests, options))  # type: ignore[arg-type]
    spec = EngineSpec.make(model, options)  # type: ignore[arg-type]
    if is_meta_call():
        from .prestart import prestart

        prestart(spec)  # graph construction on the client: workers start the engine now
        return placeholder_output(pdf)
    if len(pdf) == 0:
        return placeholder_output(pdf)

    requests = read_requests(pdf, prompt_column, per_row, base)
    return output_frame(pdf, run_requests(spec, requests))


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
    from .spec import EngineSpec

    return run_requests(EngineSpec.from_msg(spec), requests)
