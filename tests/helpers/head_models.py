"""A tiny grouped-query llama over the byte tokenizer's vocabulary, for the retrieval-head tests."""

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import llama

from helpers.ruler_helpers import VOCAB

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
