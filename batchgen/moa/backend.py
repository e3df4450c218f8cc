"""`batchgen run --models a=DIR b=DIR ...` (or `--models models.toml`): one OpenAI batch file
whose lines name different `body.model` values, each line run on its model.

Each model's tokenizer and limits check its own lines (a line naming no model of the job gets
a per-line `model_not_found` error); the rows then go to a ModelPool, placed by `place` over
the whole file (the placement needs every row's demand, so this backend holds the valid rows'
token ids in memory, unlike the single-model one), on a Dask cluster or in this process. The
sink, per-line errors and `--resume` are batchgen run's own (batchgen/io).
"""
from __future__ import annotations

import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BatchgenError
from ..policy.placement import Placement, Policy
from .pool import Item, ModelPool

if TYPE_CHECKING:
    from distributed import Client

    from ..io.job import JobSummary
    from ..io.spec import JobSpec
    from ..outputs import RequestOutput


MAP_SUFFIXES = (".toml", ".yaml", ".yml")


def read_map_file(path: Path, what: str) -> dict[str, Any]:
    """A TOML (tomllib) or YAML (PyYAML, a dask dependency) file's top-level table."""
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        else:
            data = _load_yaml(text)
    except Exception as exc:  # noqa: BLE001 - OSError, TOMLDecodeError, yaml.YAMLError: one message
        raise BatchgenError(f"{what} {path}: {exc}") from None
    if not isinstance(data, dict):
        raise BatchgenError(f"{what} {path}: expected a table of keys, got {type(data).__name__}")
    return data


def _load_yaml(text: str) -> Any:
    """yaml.safe_load, but a key given twice in one mapping is an error (PyYAML keeps the last:
    two proposers of one name would silently be one), as it is in TOML."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def parse_models(values: Sequence[str]) -> dict[str, str]:
    """`name=DIR ...`, or one TOML/YAML file (a [models] table / `models:` mapping, or name = dir at the top)."""
    if len(values) == 1 and values[0].lower().endswith(MAP_SUFFIXES):
        path = Path(values[0])
        data = read_map_file(path, "--models")
        table = data.get("models", data)
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()) or not table:
            raise BatchgenError(f"--models {path}: expected name = \"model dir\" entries (top level or [models])")
        return {str(k): v for k, v in table.items()}
    models: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise BatchgenError(f"--models {value!r}: expected NAME=DIR")
        if name in models:
            raise BatchgenError(f"--models: {name!r} given twice")
        models[name] = path
    return models


class MultiModelBackend:
    """A job-runner backend for rows that each name their model (see io/job.py)."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool
        self.placement: Placement | None = None

    def run(self, requests: Iterable[tuple[Any, ...]], max_in_flight: int) -> Iterator[tuple[int, RequestOutput]]:
        items = [Item(pos, model, ids, params) for pos, (ids, params, model) in enumerate(requests)]
        if not items:
            return
        self.placement = self.pool.plan(items)
        self.pool.submit(items, self.placement)
        try:
            for key, out in self.pool.results():
                yield int(key), out  # type: ignore[arg-type]
        finally:
            self.pool.close()


def run_models_file_job(spec: JobSpec, models: Mapping[str, str], *, client: Client | None = None,
                        placement: Policy = "ilp", engine_options: Mapping[str, Any] | None = None,
                        chunk_size: int = 256, progress: str = "auto") -> tuple[JobSummary, Placement | None]:
    """Run a multi-model OpenAI batch file; call `spec.check()` first."""
    from ..io.job import run_job
    from ..io.rows import RowContext
    from ..models.info import ModelInfo
    from ..progress import Progress

    if spec.format != "jsonl":
        raise BatchgenError("--models runs an OpenAI batch .jsonl (each line's body.model picks its model); "
                            "for Parquet use batchgen.generate(model=..., model_column=...)")
    infos = {name: ModelInfo.load(path) for name, path in models.items()}  # ModelLoadError: exit 2
    contexts = {name: RowContext(i.tokenizer, i.vocab_size, i.max_model_len, spec.defaults) for name, i in infos.items()}
    first = next(iter(contexts.values()))
    reader, sink = spec.open(first, model=next(iter(models)), contexts=contexts)
    backend = MultiModelBackend(ModelPool(models, client=client, placement=placement, engine_options=engine_options))
    with Progress(reader.count(), initial=len(sink.done), mode=progress) as bar:  # type: ignore[arg-type]
        summary = run_job(reader.requests(sink.done), sink, backend, chunk_size=chunk_size, progress=bar)
    return summary, backend.placement
