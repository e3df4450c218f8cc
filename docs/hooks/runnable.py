"""MkDocs hook: a ```python exec fence (a block tests/project/test_docs.py runs) renders as Python.

The `exec` word is for the test only (docs/contributing.md); Markdown would not know the fence.
A fence shown inside a longer fence (an example of the convention) is left as written.
"""
from __future__ import annotations

import re
from typing import Any

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<ticks>`{3,}|~{3,})(?P<info>[^`]*)$")


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    lines, open_fence = markdown.split("\n"), None
    for i, line in enumerate(lines):
        match = FENCE.match(line)
        if not match:
            continue
        ticks, info = match["ticks"], match["info"].strip()
        if open_fence is None:
            open_fence = ticks
            if info.split()[:2] == ["python", "exec"]:
                lines[i] = f"{match['indent']}{ticks}python"
        elif ticks[0] == open_fence[0] and len(ticks) >= len(open_fence) and not info:
            open_fence = None
    return "\n".join(lines)
