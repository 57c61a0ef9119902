"""Shared set-up of the RULER tests: a tiny random llama over bytes and a byte tokenizer
with a ChatML-like template (no network, no model files)."""

from __future__ import annotations

from helpers.batch_helpers import tiny_llama

EOS = 256
VOCAB = 260


class ByteTokenizer:
    """UTF-8 bytes as token ids, ``EOS`` = 256; the chat surface of mlx-lm's wrapper."""

    has_chat_template = True
    chat_template = "chatml-like"
    eos_token_ids = {EOS}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tiny_model(seed: int = 0):
    """The batching tests' tiny llama over this tokenizer's vocabulary."""
    return tiny_llama(seed, vocab_size=VOCAB)
