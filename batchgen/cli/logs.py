"""The `batchgen` logger on stderr, at the level -v / -q / --log-level set."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def setup_logging(args: argparse.Namespace) -> None:
    """The ``batchgen`` logger to stderr; the progress bar stays tqdm's."""
    level = getattr(args, "log_level", None)
    if level is None:
        verbose, quiet = getattr(args, "verbose", None) or 0, getattr(args, "quiet", None) or 0
        level = "DEBUG" if verbose > 0 else "ERROR" if quiet > 0 else "INFO"
    logger = logging.getLogger("batchgen")
    logger.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("batchgen: %(message)s"))
        logger.addHandler(handler)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (tests and notebooks swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass
