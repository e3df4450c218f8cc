"""EngineSpec: which engine a row needs (model directory + engine options), as a hashable key.

Two partitions share an engine exactly when their specs are equal; the spec also travels in
migration messages so that a worker without that engine can build one. `factory` names the
engine class ("module:Class", any CoroutineEngine): the text Engine unless a front end (image
generation) asks for its own, so this layer never imports the front ends above it.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from ..models.hub import is_hub_id

if TYPE_CHECKING:
    from ..engine.protocol import CoroutineEngine

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
TEXT_ENGINE = "batchgen.engine:Engine"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    model: str  # absolute model directory, or a Hugging Face Hub id each host resolves itself
    options: tuple[tuple[str, Any], ...] = ()  # sorted keyword arguments of the engine class
    factory: str = TEXT_ENGINE

    @classmethod
    def make(cls, model: str | Path, options: Mapping[str, Any] | None = None, *, factory: str = TEXT_ENGINE,
             known: frozenset[str] = _ENGINE_FIELDS) -> EngineSpec:
        """Check option names against `known` (EngineConfig's fields for the text engine;
        TypeError naming an unknown one)."""
        if not isinstance(model, (str, Path)):
            raise TypeError(f"model must be a model directory or a Hugging Face Hub id (str or Path), "
                            f"got {type(model).__name__}")
        options = dict(options or {})
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"unknown engine option {name!r}{hint}; known: {sorted(known)}")
        # a hub id stays an id: each worker finds its own cache (models/hub.py), never the client's
        path = str(model) if is_hub_id(model) else str(Path(model).expanduser().absolute())
        return cls(path, tuple(sorted(options.items())), factory)

    @property
    def key(self) -> str:
        """Stable text key: the model name in load reports and migration orders."""
        opts = ",".join(f"{k}={v!r}" for k, v in self.options)
        key = f"{self.model}|{opts}" if opts else self.model
        return key if self.factory == TEXT_ENGINE else f"{key}|{self.factory}"

    def to_msg(self) -> dict[str, Any]:
        return {"model": self.model, "options": [list(kv) for kv in self.options], "factory": self.factory}

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> EngineSpec:
        return cls(str(msg["model"]), tuple(sorted((str(k), v) for k, v in msg["options"])),
                   str(msg.get("factory", TEXT_ENGINE)))

    def build(self) -> CoroutineEngine:
        module, _, name = self.factory.partition(":")
        engine_class = getattr(importlib.import_module(module), name)
        return engine_class(self.model, **dict(self.options))
