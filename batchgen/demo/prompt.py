"""The prompt the demo model was trained on (torch-free: the examples format rows with it)."""
from __future__ import annotations

# The chat template of the shipped tokenizer applied to one user message: a plain prompt column
# (batchgen.generate, `batchgen run` with "prompt") and chat messages give the same tokens (the
# template starts with bos_token; tests/test_demo.py checks).
DEMO_INSTRUCTION = "Normalize the date: {text}"
DEMO_PROMPT = "<|im_start|>user\n" + DEMO_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n"
# What the answer ends with (a stop token of the model's generation_config).
DEMO_STOP = "<|im_end|>"
# Enough for YYYY-MM-DD plus the stop token (each digit is one token).
DEMO_MAX_TOKENS = 16
