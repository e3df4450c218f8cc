"""The demo: a trained tiny MoE that normalizes messy dates, shipped in the package, with its
prompt and its tokenizer's special tokens.

    batchgen.demo.demo_model_dir()          # the trained checkpoint inside the package
    batchgen.demo.variant_dirs()            # smaller, weaker ones (name -> dir): MoA's proposers
    batchgen.demo.DEMO_PROMPT.format(text="Sunday, March 7, 2021")
"""
from __future__ import annotations

from pathlib import Path

from .prompt import DEMO_INSTRUCTION, DEMO_MAX_TOKENS, DEMO_PROMPT, DEMO_STOP
from .tokens import BOS_ID, CHAT_TEMPLATE, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID, SPECIAL_TOKENS


def demo_model_dir() -> Path:
    """The trained date-normalizing checkpoint shipped with batchgen (Hugging Face layout)."""
    return Path(__file__).resolve().parent / "model"


def variant_dirs() -> dict[str, Path]:
    """Smaller trained variants of the demo model (other sizes, seeds and step counts, so other
    accuracies), name -> checkpoint directory, sorted by name. Each has its training.json."""
    root = Path(__file__).resolve().parent / "variants"
    return {d.name: d for d in sorted(root.iterdir()) if (d / "config.json").is_file()} if root.is_dir() else {}


__all__ = [
    "BOS_ID", "CHAT_TEMPLATE", "DEMO_INSTRUCTION", "DEMO_MAX_TOKENS", "DEMO_PROMPT", "DEMO_STOP", "EOS_ID",
    "IM_END_ID", "IM_START_ID", "PAD_ID", "SPECIAL_TOKENS", "demo_model_dir", "variant_dirs",
]
