"""Model names as directories: a local directory as it is, a Hugging Face Hub id
(`org/name`, optionally `org/name@revision`) as its snapshot in the hub's cache.

Every entry point (Engine, batchgen.generate, `batchgen run --model`, models.toml) reaches a
checkpoint through `model_dir`, so each gets hub ids. A local directory wins over an id of the
same spelling. A cached snapshot is used without asking the network (pin `@revision` to be
exact across hosts), so each host resolves an id once: the first process downloads under a file
lock on the cache, the others wait and then find the files. huggingface_hub's own settings
apply: HF_HOME / HF_HUB_CACHE (where), HF_HUB_OFFLINE (never ask the network), HF_TOKEN (gated
or private repositories). See docs/guides/chat-dataframe.md.
"""
from __future__ import annotations

import os
import re
import threading
from pathlib import Path

from ..errors import ModelLoadError

# Only what the engine reads: config, weights and their index, tokenizer, generation config
METADATA_FILES = ("config.json", "generation_config.json", "*.safetensors.index.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
WEIGHT_FILES = ("*.safetensors",)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
_TRUE = frozenset({"1", "on", "yes", "true"})
_resolved: dict[tuple[str, str | None, bool, str], Path] = {}  # this process's answers: a host asks once
_resolving = threading.Lock()


def parse_hub_id(model: str | Path) -> tuple[str, str | None] | None:
    """("org/name", revision or None) when `model` is spelled as a hub id, else None."""
    match = _HUB_ID.fullmatch(str(model))
    return (match["repo"], match["revision"]) if match else None


def is_hub_id(model: str | Path) -> bool:
    """A hub id that names no local directory (a local directory always wins)."""
    return parse_hub_id(model) is not None and not Path(model).expanduser().is_dir()


def model_dir(model: str | Path, *, weights: bool = True) -> Path:
    """The directory of `model`: itself when local (or not a hub id: the loader then says what
    is missing), else the hub snapshot with the files the engine reads. weights=False fetches
    everything but the safetensors shards (a driver that only tokenizes)."""
    path = Path(model).expanduser()
    parsed = None if path.is_dir() else parse_hub_id(model)
    if parsed is None:
        return path
    cache = hub_cache()
    key = (*parsed, weights, str(cache))
    with _resolving:
        if key not in _resolved:
            _resolved[key] = _resolve(*parsed, weights, cache)
        return _resolved[key]


def hub_cache() -> Path:
    """Read at call time (not at huggingface_hub's import), so a worker's environment counts."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def _resolve(repo: str, revision: str | None, weights: bool, cache: Path) -> Path:
    from filelock import FileLock

    patterns = [*METADATA_FILES, *(WEIGHT_FILES if weights else ())]
    name = repo + (f"@{revision}" if revision else "")
    lock_dir = cache / ".locks" / ("models--" + repo.replace("/", "--"))
    if not is_offline():
        try:
            lock_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # a read-only cache: nothing can be downloaded into it, only read (below)
        else:
            # one process per host downloads; the others wait here, then find the files (never a
            # snapshot half-written by a download in flight)
            with FileLock(str(lock_dir / "batchgen-resolve.lock")):
                cached = _cached(repo, revision, cache, patterns, weights)
                return cached if cached is not None else _download(repo, revision, cache, patterns, name)
    cached = _cached(repo, revision, cache, patterns, weights)  # no lock: offline caches may be read-only
    if cached is not None:
        return cached
    raise ModelLoadError(
        f"model {name!r} is neither a local directory nor in the Hugging Face cache {str(cache)!r} "
        f"({'HF_HUB_OFFLINE is set' if is_offline() else 'which is read-only'}); download it first with "
        f"`hf download {repo}{f' --revision {revision}' if revision else ''}` (HF_HUB_CACHE / HF_HOME pick "
        "the cache), or pass a local directory")


def _cached(repo: str, revision: str | None, cache: Path, patterns: list[str], weights: bool) -> Path | None:
    """The cached snapshot when it holds what the engine reads, without the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo, revision=revision, cache_dir=str(cache), allow_patterns=patterns,
                                      local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None
    if not (path / "config.json").is_file() or (weights and not any(path.glob("*.safetensors"))):
        return None  # a partial snapshot (a driver's, without weights): fetch the rest
    return path


def _download(repo: str, revision: str | None, cache: Path, patterns: list[str], name: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=str(cache), allow_patterns=patterns))
    except GatedRepoError as exc:
        raise ModelLoadError(f"model {name!r} is gated: accept its terms on huggingface.co and set HF_TOKEN "
                             f"({exc})") from exc
    except RevisionNotFoundError as exc:
        raise ModelLoadError(f"model {name!r}: no such revision on the Hugging Face Hub ({exc})") from exc
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(f"model {name!r} is neither a local directory nor a Hugging Face Hub repository "
                             f"you can read (private ones need HF_TOKEN) ({exc})") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelLoadError(f"cannot download model {name!r} from the Hugging Face Hub: {exc}") from exc
