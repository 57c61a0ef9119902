"""KVCacheConfig validation and KVCacheBuilder.for_model on tiny random mlx-lm models."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.generate import generate_step

from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(qfilters_budget=8, qfilters_n_sink=4, qfilters_recent=8), "qfilters_n_sink"),
        (dict(qfilters_budget=8, qfilters_n_sink=4, qfilters_recent=4), "qfilters_n_sink"),
        (dict(qfilters_budget=0), "qfilters_budget"),
        (dict(qfilters_budget=None), "qfilters_budget"),
        (dict(qfilters_recent=-1), "qfilters_recent"),
        (dict(qfilters_n_sink=-1), "qfilters_n_sink"),
        (dict(qfilters_budget=8, qfilters_n_sink=9), "qfilters_n_sink"),
        (dict(qfilters_calib_tokens=0), "qfilters_calib_tokens"),
        (dict(qfilters_sign=0), "qfilters_sign"),
        (dict(qfilters_sign=2), "qfilters_sign"),
        (dict(qfilters_sign=True), "qfilters_sign"),
        (dict(method="h2o"), "method"),
        (dict(head_dim=0), "head_dim"),
    ],
)
def test_invalid_configs_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KVCacheConfig(**kwargs)


def test_wrong_types_raise_type_error():
    with pytest.raises(TypeError, match="qfilters_budget"):
        KVCacheConfig(qfilters_budget="512", qfilters_recent=0, qfilters_filter_source="keys")
    with pytest.raises(TypeError, match="qfilters_recent"):
        KVCacheConfig(qfilters_recent=2.0, qfilters_filter_source="keys")


def test_streaming_llm_window_is_budget_minus_sinks():
    cfg = KVCacheConfig(method="streaming_llm", qfilters_budget=64, qfilters_n_sink=4, qfilters_recent=100)
    assert cfg.protected_recent == 60
    assert KVCacheConfig(qfilters_budget=64, qfilters_recent=16, qfilters_filter_source="keys").protected_recent == 16


def test_metal_backend_is_built_on_metal_and_refused_clearly_elsewhere():
    """backend="metal" works where MLX has a Metal GPU (a Mac) and raises at construction,
    naming the backend and the cause, everywhere else."""
    cfg = KVCacheConfig(qfilters_recent=0, qfilters_filter_source="keys")
    if mx.metal.is_available():
        assert QFiltersKVCache(cfg, backend="metal").backend.name == "metal"
    else:
        with pytest.raises(ValueError, match=r"backend='metal' is not available: this MLX has no Metal GPU"):
            QFiltersKVCache(cfg, backend="metal")


def tiny_llama(n_kv_heads=2, head_dim=None, layers=2, heads=4, hidden=64):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=heads, rms_norm_eps=1e-5, vocab_size=97, num_key_value_heads=n_kv_heads,
        head_dim=head_dim, rope_theta=10000.0, tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_seed_usage_works_as_written():
    model = tiny_llama(head_dim=16)
    config = KVCacheConfig(method="qfilters", head_dim=16, qfilters_budget=32, qfilters_n_sink=4,
                           qfilters_recent=0, qfilters_calib_tokens=16, qfilters_sign=1, qfilters_filter_source="keys")
    caches = KVCacheBuilder.for_model(model, config)
    model.make_cache = lambda *_a, **_k: caches
    assert len(caches) == 2 and all(isinstance(c, QFiltersKVCache) for c in caches)
    fed = []

    class Counting:
        """Delegates to the model and counts the tokens fed to it."""

        layers = model.layers

        def make_cache(self):
            return model.make_cache()

        def __call__(self, inputs, cache=None, **kw):
            fed.append(inputs.shape[1])
            return model(inputs, cache=cache, **kw)

    prompt = mx.array(np.arange(60) % 97)
    toks = [int(t) for t, _ in generate_step(prompt, Counting(), max_tokens=20, prefill_step_size=16)]
    assert len(toks) == 20 and fed[:4] == [16, 16, 16, 11]
    assert all(c.size() == 32 for c in caches) and all(c.offset == sum(fed) for c in caches)


def test_head_dim_checked_and_inferred():
    model = tiny_llama(head_dim=None, hidden=64, heads=4)  # args lack head_dim -> 64 // 4
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=16, qfilters_recent=0, qfilters_filter_source="keys"))
    assert caches[0].config.head_dim == 16
    with pytest.raises(ValueError, match="head_dim"):
        KVCacheBuilder.for_model(model, KVCacheConfig(head_dim=128, qfilters_recent=0, qfilters_filter_source="keys"))
    with pytest.raises(TypeError, match="config"):
        KVCacheBuilder.for_model(model, {"method": "qfilters"})


@pytest.mark.parametrize("recent", [4, [[4, 5]] * 30], ids=["one window", "per-head table"])
def test_building_a_model_s_caches_validates_the_config_once(monkeypatch, recent):
    """A 30-layer model's caches: the per-layer copies (head_dim, the layer's row of a
    per-head table) are not validated again; only the throwaway trial caches' one config is."""
    import qfilters_mlx.config.method as method

    model = tiny_llama(layers=30)
    cfg = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=recent,
                        qfilters_filter_source="keys")
    calls = []
    resolved = method._resolved
    monkeypatch.setattr(method, "_resolved", lambda values: calls.append(1) or resolved(values))
    caches = KVCacheBuilder.for_model(model, cfg, backend="reference")
    assert len(calls) == 1
    rows = [c.config for c in caches]
    assert [c.head_dim for c in rows] == [16] * 30 and {c.qfilters_budget for c in rows} == {16}
    want = [4] * 30 if recent == 4 else [(4, 5)] * 30
    assert [c.qfilters_recent for c in rows] == want
    assert rows[0] == KVCacheConfig(head_dim=16, qfilters_budget=16, qfilters_n_sink=2,
                                    qfilters_recent=want[0], qfilters_filter_source="keys")
    with pytest.raises(ValueError, match="head_dim"):
        cfg.with_head_dim(0)


def test_gqa_32_query_heads_over_8_kv_heads():
    model = tiny_llama(n_kv_heads=8, heads=32, hidden=512, layers=1)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=16, qfilters_calib_tokens=8, qfilters_recent=0, qfilters_filter_source="keys"))
    model(mx.array([list(range(40))]), cache=caches)
    c = caches[0]
    assert c.filter.shape == (8, 16) and c.keys.shape[1] == 8 and c.size() == 16


def test_non_attention_layers_keep_model_cache():
    """gemma3_text mixes sliding-window (RotatingKVCache) and global layers; read from the model.

    The builder probes the model with a forward pass, so the test uses a real (tiny) model."""
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=32, num_hidden_layers=3,
                                 intermediate_size=64, num_attention_heads=4, head_dim=8,
                                 num_key_value_heads=2, vocab_size=64, sliding_window=8,
                                 sliding_window_pattern=2)
    m = gemma3_text.Model(args)
    m.make_cache = lambda *_a, **_k: ["stale"]  # a previous override is ignored
    caches = KVCacheBuilder.for_model(m, KVCacheConfig(qfilters_budget=16, qfilters_recent=0, qfilters_filter_source="keys"))
    assert type(caches[0]) is RotatingKVCache and type(caches[2]) is RotatingKVCache
    assert isinstance(caches[1], QFiltersKVCache) and caches[1].layer_idx == 1
    assert "partial" in repr(caches) and "RotatingKVCache at 0, 2" in repr(caches)


@pytest.mark.parametrize("method", ["qfilters", "l2norm", "streaming_llm", "random", "full"])
def test_logits_equal_plain_kvcache_when_budget_covers_sequence(method):
    model = tiny_llama(head_dim=16)
    tokens = mx.array([[(7 * i) % 97 for i in range(48)]])
    ref_cache = [KVCache() for _ in model.layers]
    ours = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, qfilters_budget=64,
                                                         qfilters_calib_tokens=8, qfilters_recent=0, qfilters_filter_source="keys"))
    for start, L in [(0, 20), (20, 1), (21, 7), (28, 20)]:
        chunk = tokens[:, start:start + L]
        want = model(chunk, cache=ref_cache)
        got = model(chunk, cache=ours)
        np.testing.assert_array_equal(np.array(got), np.array(want))
    assert all(c.offset == 48 and c.size() == 48 for c in ours)


def test_budget_beyond_int32_and_bad_filters_rejected():
    with pytest.raises(ValueError, match="qfilters_budget"):
        KVCacheConfig(qfilters_budget=2**31, qfilters_recent=0, qfilters_filter_source="keys")
    model = tiny_llama(head_dim=16)
    with pytest.raises(TypeError, match="floating"):
        KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_filters=np.zeros((2, 2, 16), np.int32), qfilters_recent=0))
    with pytest.raises(ValueError, match="shape"):
        KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_filters=np.zeros((2, 2, 8), np.float32), qfilters_recent=0))
    with pytest.raises(ValueError, match="qfilters_filters"):
        KVCacheConfig(qfilters_filters=[1.0, 2.0])
    c = QFiltersKVCache(KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1, qfilters_recent=0, qfilters_filter_source="keys"), filters=mx.zeros((2, 16)))
    k = mx.zeros((1, 3, 4, 16))  # 3 heads: the filters have 2
    with pytest.raises(ValueError, match="filters shape"):
        c.update_and_fetch(k, k)
    assert c.empty() and c.offset == 0


def test_batching_merges_into_our_batch_cache_never_a_plain_cache():
    """mlx-lm batches caches through `merge` (BatchGenerator's `_merge_caches`): ours become a
    BatchQFiltersCache whose rows keep exactly their kept positions; caches of different
    configurations are refused naming the field (never silently a plain cache)."""
    from mlx_lm.generate import _merge_caches

    from qfilters_mlx.cache.batch import BatchQFiltersCache

    model = tiny_llama(head_dim=16)
    cfg = KVCacheConfig(qfilters_budget=16, qfilters_recent=0, qfilters_filter_source="keys")
    a = KVCacheBuilder.for_model(model, cfg)
    b = KVCacheBuilder.for_model(model, cfg)
    for caches, n in ((a, 50), (b, 30)):
        model(mx.array([list(range(n))]), cache=caches)
    merged = _merge_caches([a, b])
    assert all(type(c) is BatchQFiltersCache for c in merged)
    for layer in range(len(a)):
        for row, alone in enumerate((a, b)):
            got = merged[layer].extract(row).kept_positions()
            assert got.tolist() == alone[layer].kept_positions().tolist()
    other = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=24, qfilters_recent=0,
                                                          qfilters_filter_source="keys"))
    model(mx.array([list(range(40))]), cache=other)
    with pytest.raises(ValueError, match="budget"):
        _merge_caches([a, other])


def test_install_builds_fresh_caches_for_every_generation():
    from mlx_lm.generate import generate_step

    model = tiny_llama(head_dim=16)
    KVCacheBuilder.install(model, KVCacheConfig(qfilters_budget=16, qfilters_calib_tokens=8, qfilters_recent=0, qfilters_filter_source="keys"))
    first, second = model.make_cache(), model.make_cache()
    assert first[0] is not second[0] and first[0].offset == 0
    prompt = mx.array(list(range(40)))
    runs = [[int(t) for t, _ in generate_step(prompt, model, max_tokens=10)] for _ in range(2)]
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="head_dim"):
        KVCacheBuilder.install(model, KVCacheConfig(head_dim=64, qfilters_recent=0, qfilters_filter_source="keys"))


@pytest.mark.parametrize("kw", [{"qfilters_filter_source": "queries"},
                                {"qfilters_filter_source": "keys", "qfilters_sign": "auto"}])
def test_install_refuses_configs_that_need_observed_queries(kw):
    """mlx-lm builds installed caches itself (generate, the server), outside observe_queries:
    the online query filter could never be estimated, so install refuses it and changes
    nothing (the default, the calibrated filter, needs no queries: tests/filters/test_default_filters.py)."""
    model = tiny_llama(head_dim=16)
    before = model.make_cache
    with pytest.raises(ValueError, match=r"install: .*observed queries.*qfilters_filter_source='calibrated'"):
        KVCacheBuilder.install(model, KVCacheConfig(qfilters_budget=16, **kw))
    assert model.make_cache == before
