"""The Engine API on the trained demo model (it normalizes messy dates to YYYY-MM-DD): batch
generate, per-row sampling, a bad row failing alone, chat messages, suspend/resume.

    python examples/engine_basic.py [MODEL_DIR]
"""
from __future__ import annotations

import sys

from batchgen import Engine, SamplingParams
from batchgen.demo import DEMO_INSTRUCTION, DEMO_MAX_TOKENS, DEMO_PROMPT, demo_model_dir


def main() -> None:
    model_dir = sys.argv[1] if len(sys.argv) > 1 else str(demo_model_dir())
    engine = Engine(model_dir, dtype="float32")
    texts = ["Sunday, March 7, 2021", "the 7th of June, 1999", "2004.11.30", "12/25/1987"]
    greedy = SamplingParams(max_tokens=DEMO_MAX_TOKENS, temperature=0.0)
    prompts = [DEMO_PROMPT.format(text=t) for t in texts] + [""]  # the empty prompt fails alone
    params = [greedy, greedy, SamplingParams(max_tokens=DEMO_MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7),
              greedy, greedy]
    for prompt, out in zip(texts + ["(empty)"], engine.generate(prompts, params)):
        print(f"{prompt!r:26} -> {out.finish_reason:6} {out.error or repr(out.text)}")

    # Chat messages, as vLLM's LLM.chat: the model's chat template renders them (the demo prompt
    # above is that template applied by hand, so the answers agree)
    chats = [[{"role": "user", "content": DEMO_INSTRUCTION.format(text=t)}] for t in texts[:2]]
    for conversation, out in zip(chats, engine.chat(chats, greedy)):
        print(f"chat {conversation[0]['content']!r} -> {out.finish_reason} {out.text!r} "
              f"({out.num_prompt_tokens} prompt tokens)")

    # A coroutine leaves one engine mid-generation and finishes in another with the same tokens.
    prompt = DEMO_PROMPT.format(text="the 3rd of August, 1961")
    seq_id = engine.add_request(prompt, greedy)
    for _ in range(4):
        engine.step()
    state = engine.suspend(seq_id)  # bytes: tokens, sampling state, maybe KV
    other = Engine(model_dir, dtype="float32")
    resumed = other.resume(state)
    while not other.get(resumed).is_finished:
        other.step()
    moved = other.pop_output(resumed)
    straight = engine.generate([prompt], greedy)[0]
    print(f"suspend/resume exact: {moved.token_ids == straight.token_ids} ({len(state)} bytes of state): "
          f"{straight.text!r}")
    print("stats:", engine.stats_summary())


if __name__ == "__main__":
    main()
