"""The front ends: `batchgen.diffuse` on a DataFrame partition and `batchgen run` on an
OpenAI-style image JSONL."""
