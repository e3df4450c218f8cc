"""MkDocs hook: renders `batchgen --help` and each subcommand's `--help` into the CLI reference.

A page writes a line `<!-- cli-help -->`; the hook replaces it with the help texts, taken from the
argparse parser at build time, so the flags are documented once (in batchgen/cli/parser.py).
"""
from __future__ import annotations

import argparse
import os
from typing import Any

MARKER = "<!-- cli-help -->"


def _parser() -> argparse.ArgumentParser:
    from batchgen.cli import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render(width: int = 100) -> str:
    """Every command's help at a fixed width (argparse reads COLUMNS), restoring the caller's."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        parser = _parser()
        parts = ["## batchgen", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in _subparsers(parser).items():
            parts += [f"## batchgen {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
