"""A tiny random llama with GQA (9 query heads over 3 KV heads), for the query-filter,
window-calibration and segment tests."""

import mlx.core as mx
from mlx_lm.models import llama


def tiny_llama(seed=0, layers=2, kv=3, heads=9, hidden=144):
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=64, num_attention_heads=heads, rms_norm_eps=1e-5,
                           vocab_size=101, num_key_value_heads=kv, rope_theta=10000.0)
    mx.random.seed(seed)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m
