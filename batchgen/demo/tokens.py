"""The demo tokenizer's special tokens and chat template (the shipped demo model's, and the
random-weight checkpoints' the tests build in the same layout)."""
from __future__ import annotations

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# ChatML, as Qwen ships it, with bos_token first: chat prompts are encoded without special tokens
# (as transformers does), so the template itself supplies the <s> a plain prompt gets from encode()
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
