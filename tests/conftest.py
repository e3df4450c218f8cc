"""Session fixtures: the tiny tokenizer, tiny checkpoints per architecture, mixed-length prompts."""
from __future__ import annotations

import os

# Set before transformers/tokenizers are imported: tests never touch the network, and
# tokenizers' own thread pool must not fight Dask worker processes after a fork.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

# tests/<wing>/ import the tiny-model builders by name (`import tiny_models`); Dask worker
# processes inherit this path when they unpickle a test's function
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter. Set here, before any test module
# imports triton (diffusers and others import it at collection), since the mode is fixed then.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CI box has 2 cores; more threads than cores only adds contention (under pytest-xdist two
# test processes share them: one thread each).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(torch.get_num_threads(), 2))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def mixed_prompts(tokenizer: object, lengths: tuple[int, ...] | None = None) -> list[list[int]]:
    """~8 deterministic prompts (token ids, BOS first) with lengths spread over 1..200.

    `tokenizer`: a tokenizer dir, a `tokenizers.Tokenizer`, or anything with
    `encode(text, add_special_tokens=False)`. See tiny_models.mixed_prompts."""
    import tiny_models

    return tiny_models.mixed_prompts(tokenizer, lengths or tiny_models.PROMPT_LENGTHS)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer (with chat_template) that every tiny checkpoint shares."""
    import tiny_models

    return tiny_models.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`factory(arch, legacy_rope_keys=False) -> dir`: a tiny checkpoint, built once per session."""
    import tiny_models

    built: dict[tuple[str, bool], Path] = {}

    def factory(arch: str, legacy_rope_keys: bool = False) -> Path:
        key = (arch, legacy_rope_keys)
        if key not in built:
            name = arch + ("-legacy" if legacy_rope_keys else "")
            built[key] = tiny_models.build_checkpoint(
                arch, tmp_path_factory.mktemp(name), legacy_rope_keys=legacy_rope_keys
            )
        return built[key]

    return factory


@pytest.fixture(scope="session")
def prompt_ids(tokenizer_dir: Path) -> list[list[int]]:
    """`mixed_prompts` of the shared tiny tokenizer."""
    return mixed_prompts(tokenizer_dir)
