"""capture_attention sees post-RoPE queries and restores every patched module."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base, llama
from mlx_lm.models.cache import KVCache

from qfilters_mlx.filters.capture import capture_attention


def tiny():
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2,
                           intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=50, num_key_value_heads=2)
    mx.random.seed(1)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def snapshot():
    return {n: getattr(m, "scaled_dot_product_attention") for n, m in list(sys.modules.items())
            if n.startswith("mlx_lm.models.") and hasattr(m, "scaled_dot_product_attention")}


def test_queries_are_post_rope_and_layers_indexed():
    model = tiny()
    caches = [KVCache() for _ in model.layers]
    seen = []
    tokens = mx.array([[3, 1, 4, 1, 5, 9]])
    with capture_attention(model, lambda l, q, k: seen.append((l, q, k)), caches=caches):
        model(tokens, cache=caches)
    assert [s[0] for s in seen] == [0, 1]
    layer0, q, k = seen[0]
    assert q.shape == (1, 4, 6, 8) and k.shape == (1, 2, 6, 8)
    # recompute layer 0's post-RoPE queries by hand
    attn = model.model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(model.model.embed_tokens(tokens))
    q_pre = attn.q_proj(h).reshape(1, 6, 4, 8).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.array(q), np.array(attn.rope(q_pre)), atol=1e-5)


def test_restores_every_patched_module_also_after_exception():
    model = tiny()
    before = snapshot()
    assert before["mlx_lm.models.llama"] is base.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="boom"):
        with capture_attention(model, lambda *a: None):
            assert sys.modules["mlx_lm.models.llama"].scaled_dot_product_attention is not before["mlx_lm.models.llama"]
            raise RuntimeError("boom")
    assert snapshot() == before
    with pytest.raises(ValueError):
        with capture_attention(model, lambda *a: (_ for _ in ()).throw(ValueError("cb"))):
            model(mx.array([[1, 2]]))
    assert snapshot() == before
