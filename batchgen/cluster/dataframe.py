"""generate_dataframe: a lazy Dask DataFrame of generated rows, with the schema given up front."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .client import install, is_installed
from .generate import generate, output_meta

if TYPE_CHECKING:
    import dask.dataframe as dd
    from distributed import Client


def generate_dataframe(ddf: dd.DataFrame, *, client: Client | None = None, **options: Any) -> dd.DataFrame:
    """`ddf.map_partitions(batchgen.generate, **options, meta=batchgen.output_meta(ddf, **options))`.

    Every option of `batchgen.generate` (model, prompt_column, messages_column,
    chat_template_kwargs, add_generation_prompt, model_column, per_row, engine_options,
    expert_memory, expert_host_memory, output_prefix, sampling fields) is checked here, before
    any work. With a `client` (or a default client), the batchgen plugin is registered first if
    it is not yet. Nothing runs until the result is computed. See docs/guides/chat-dataframe.md.
    """
    if "model" not in options:
        raise TypeError("generate_dataframe() missing the keyword argument 'model'")
    meta = output_meta(ddf, **options)
    if client is None:
        client = _default_client()
    if client is not None and not is_installed(client):
        install(client)
    return ddf.map_partitions(generate, meta=meta, **options)


def _default_client() -> Client | None:
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None
