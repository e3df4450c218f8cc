"""Structured outputs: JSON schema, regex, choice and grammar constraints on a row's tokens.

params.py (torch-free, library-free: the spec); compiler.py (llguidance grammars, compiled once
per engine and spec); rows.py (each row's matcher, rebuilt from its tokens when missing);
bitmask.py (the packed token mask the sampler applies). Only params is imported here, so the
torch-free core can import this package.
"""
from __future__ import annotations

from .params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
