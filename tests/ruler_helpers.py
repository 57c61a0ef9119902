"""Shared set-up of the RULER tests: a tiny random llama over bytes and a byte tokenizer
with a ChatML-like template (no network, no model files)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import llama

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


def tiny_model(seed: int = 0, layers: int = 2):
    """A float32 llama (hidden 64, 4 query / 2 KV heads of 16), weights scaled by 3 so that
    greedy tokens vary."""
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=layers,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=VOCAB, head_dim=16, tie_word_embeddings=True)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 3, model.parameters()))
    mx.eval(model.parameters())
    return model
