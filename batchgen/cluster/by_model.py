"""`batchgen.generate(..., model_column=...)`: each row of a partition on the model its column
names. The rows of every model open a job on this worker's (or process's) engine for it at
once, so the models run side by side; a name outside `model` fails that row alone."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelLoadError
from ..io.cells import is_na
from ..models.hub import is_hub_id
from ..outputs import RequestOutput
from .spec import EngineSpec
from .task import this_host, wait_for

if TYPE_CHECKING:
    import pandas as pd


def run_by_model(pdf: pd.DataFrame, models: Mapping[str, str | Path], model_column: str,
                 requests: list[tuple[Any, Any]], options: Mapping[str, Any]) -> list[RequestOutput]:
    if model_column not in pdf.columns:
        raise KeyError(f"model_column {model_column!r} is not a column of the partition; columns: {list(pdf.columns)}")
    specs = {str(name): EngineSpec.make(path, options) for name, path in models.items()}
    outputs: list[RequestOutput | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(pdf[model_column].tolist()):
        key = name if isinstance(name, str) else None if is_na(name) else str(name)  # {1: dir} names 1 as "1"
        if key in specs:
            groups.setdefault(key, []).append(i)
        else:
            outputs[i] = RequestOutput(i, [], [], "", "error",
                                       f"{model_column}={name!r}: unknown model; known: {sorted(specs)}")
    host = this_host()
    jobs = [(rows, host.open_job(specs[name], [requests[i] for i in rows])) for name, rows in groups.items()]
    try:
        wait_for(job for _, job in jobs)
        for rows, job in jobs:
            for i, out in zip(rows, job.result()):
                out.index = i
                outputs[i] = out
    finally:
        for _, job in jobs:
            host.close_job(job)
    return outputs  # type: ignore[return-value]


def spec_for_meta(models: Mapping[str, str | Path], options: Mapping[str, Any]) -> dict[str, EngineSpec]:
    """Check every model's engine options before any work (TypeError on an unknown one)."""
    if not isinstance(models, Mapping) or not models:
        raise TypeError("with model_column, model must be a non-empty mapping of name -> model directory")
    specs = {str(n): EngineSpec.make(p, options) for n, p in models.items()}
    for name, spec in specs.items():  # every model, not only those this partition's rows name
        if not is_hub_id(spec.model) and not Path(spec.model, "config.json").is_file():
            raise ModelLoadError(f"model {name!r}: {spec.model} is not a model directory (no config.json)")
    return specs


