"""A tiny grouped-query llama over the byte tokenizer's vocabulary, and the needle attention written
out in numpy, for the retrieval-head tests."""

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models import llama

from helpers.ruler_helpers import VOCAB
from qfilters_mlx.filters.window_capture import keys_and_queries

HD, H_Q, H_KV, LAYERS = 16, 8, 4, 3


def gqa_model(seed: int = 0):
    """3 layers, 8 query heads on 4 KV heads, byte vocabulary, random weights (scaled by 3)."""
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=LAYERS, intermediate_size=96,
                           num_attention_heads=H_Q, num_key_value_heads=H_KV, rms_norm_eps=1e-5,
                           vocab_size=VOCAB, head_dim=HD, rope_theta=10000.0)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 3, model.parameters()))
    mx.eval(model.parameters())
    return model


def np_needle_mass(model, prompt) -> np.ndarray:
    """The needle attention written out from mlx-lm's own full-cache pass: per layer and KV head,
    the softmax weight (causal, the layer's scale) each query predicting an answer key token
    gives the needle's key tokens, averaged over those queries and the KV head's query heads
    (float64, from the post-RoPE queries and keys that pass captured)."""
    (layers,) = keys_and_queries(model, [prompt.tokens[:-1]])
    n = len(prompt.key_positions)
    cols = slice(prompt.needle_position, prompt.needle_position + n)
    out = []
    for layer, (keys, queries, _) in zip(model.layers, layers):
        h_kv, h_q = keys.shape[0], queries.shape[0]
        mass = np.zeros(h_kv)
        for qh in range(h_q):
            for p in prompt.key_positions:
                t = p - 1
                w = keys[qh // (h_q // h_kv), :t + 1].astype(np.float64) @ queries[qh, t] * layer.self_attn.scale
                w = np.exp(w - w.max())
                mass[qh // (h_q // h_kv)] += w[cols].sum() / w.sum()
        out.append(mass / (h_q // h_kv) / n)
    return np.stack(out)
