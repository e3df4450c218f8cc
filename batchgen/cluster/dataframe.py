"""generate_dataframe: a lazy Dask DataFrame of generated rows, with the schema given up front."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .client import install, is_installed
from .frame import check_columns, placeholder_output
from .generate import generate

if TYPE_CHECKING:
    import dask.dataframe as dd
    from distributed import Client


def generate_dataframe(ddf: dd.DataFrame, *, model: str | Path, client: Client | None = None,
                       prompt_column: str = "prompt", per_row: Mapping[str, str] | None = None,
                       engine_options: Mapping[str, Any] | None = None, **sampling: Any) -> dd.DataFrame:
    """`ddf.map_partitions(batchgen.generate, ...)` with explicit `meta` (no inference call).

    With a `client` (or a default client), the batchgen plugin is registered first if it is not
    yet. Nothing runs until the result is computed. Arguments as for `batchgen.generate`.
    """
    if client is None:
        client = _default_client()
    if client is not None and not is_installed(client):
        install(client)
    per_row = dict(per_row or {})
    check_columns(ddf._meta, prompt_column, per_row)
    meta = placeholder_output(ddf._meta)
    return ddf.map_partitions(generate, model=str(model), prompt_column=prompt_column, per_row=per_row,
                              engine_options=dict(engine_options or {}), meta=meta, **sampling)


def _default_client() -> Client | None:
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None
