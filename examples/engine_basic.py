"""The Engine API on the embedded demo model: batch generate, seeded sampling, suspend/resume.

    python examples/engine_basic.py [MODEL_DIR]
"""
from __future__ import annotations

import sys

from batchgen import Engine, SamplingParams
from batchgen.demo import build_demo_model, default_demo_dir


def main() -> None:
    model_dir = sys.argv[1] if len(sys.argv) > 1 else build_demo_model(default_demo_dir())
    engine = Engine(model_dir, dtype="float32")
    prompts = ["The capital of France is", "def fibonacci(n):", "", "Once upon a time"]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=24, temperature=0.0),
                                     SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7),
                                     SamplingParams(max_tokens=24),
                                     SamplingParams(max_tokens=24, temperature=0.0, stop=["\n"])])
    for prompt, out in zip(prompts, outs):
        print(f"{prompt!r:28} -> {out.finish_reason:6} {out.error or repr(out.text)}")

    # A coroutine leaves one engine mid-generation and finishes in another with the same tokens.
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    seq_id = engine.add_request("Migrating coroutines", params)
    for _ in range(5):
        engine.step()
    state = engine.suspend(seq_id)  # bytes: tokens, sampling state, maybe KV
    other = Engine(model_dir, dtype="float32")
    resumed = other.resume(state)
    while not other.get(resumed).is_finished:
        other.step()
    moved = other.pop_output(resumed).token_ids
    straight = engine.generate(["Migrating coroutines"], params)[0].token_ids
    print(f"suspend/resume exact: {moved == straight} ({len(state)} bytes of state)")
    print("stats:", engine.stats_summary())


if __name__ == "__main__":
    main()
