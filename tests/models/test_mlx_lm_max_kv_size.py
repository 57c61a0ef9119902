"""A fact of mlx-lm the docs state (getting-started.md, evaluation.md): ``make_prompt_cache(model,
max_kv_size=N)`` ignores ``max_kv_size`` for a model class that defines ``make_cache`` (the
Llama family, SmolLM2), and gives ``RotatingKVCache`` for one that does not (Qwen2)."""

from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


def _args(mod, **kw):
    return mod.ModelArgs(model_type=mod.__name__.rsplit(".", 1)[1], hidden_size=32, num_hidden_layers=2,
                         intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                         rms_norm_eps=1e-5, vocab_size=50, **kw)


def test_llama_ignores_max_kv_size():
    model = llama.Model(_args(llama))
    assert hasattr(model, "make_cache")
    assert [type(c) for c in make_prompt_cache(model, max_kv_size=8)] == [KVCache, KVCache]


def test_qwen2_honours_max_kv_size():
    model = qwen2.Model(_args(qwen2))
    assert not hasattr(model, "make_cache")
    caches = make_prompt_cache(model, max_kv_size=8)
    assert [type(c) for c in caches] == [RotatingKVCache] * 2 and caches[0].max_size == 8
