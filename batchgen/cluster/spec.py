"""EngineSpec: which engine a row needs (model directory + engine options), as a hashable key.

Two partitions share an engine exactly when their specs are equal; the spec also travels in
migration messages so that a worker without that engine can build one.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig

if TYPE_CHECKING:
    from ..engine import Engine

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


@dataclass(frozen=True, slots=True)
class EngineSpec:
    model: str  # absolute model directory
    options: tuple[tuple[str, Any], ...] = ()  # sorted EngineConfig keyword arguments

    @classmethod
    def make(cls, model: str | Path, options: Mapping[str, Any] | None = None) -> EngineSpec:
        """Check option names against EngineConfig (TypeError naming an unknown one)."""
        if not isinstance(model, (str, Path)):
            raise TypeError(f"model must be a model directory (str or Path), got {type(model).__name__}")
        options = dict(options or {})
        for name in options:
            if name not in _ENGINE_FIELDS:
                close = difflib.get_close_matches(name, sorted(_ENGINE_FIELDS), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(f"unknown engine option {name!r}{hint}; known: {sorted(_ENGINE_FIELDS)}")
        path = str(Path(model).expanduser().absolute())
        return cls(path, tuple(sorted(options.items())))

    @property
    def key(self) -> str:
        """Stable text key: the model name in load reports and migration orders."""
        opts = ",".join(f"{k}={v!r}" for k, v in self.options)
        return f"{self.model}|{opts}" if opts else self.model

    def to_msg(self) -> dict[str, Any]:
        return {"model": self.model, "options": [list(kv) for kv in self.options]}

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> EngineSpec:
        return cls(str(msg["model"]), tuple(sorted((str(k), v) for k, v in msg["options"])))

    def build(self) -> Engine:
        from ..engine import Engine

        return Engine(self.model, **dict(self.options))
