"""KVCacheConfig's fields, its mode objects, the build options apart from it, and the earlier
flat spellings (deprecated: they warn once and map to the new ones)."""

import dataclasses
import json
import warnings

import mlx.core as mx
import numpy as np
import pytest

from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache
from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache, build_cache
from qfilters_mlx.config import (DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_REWIND, BuildOptions,
                                 CompressOnce, Streaming, config_from_state, config_to_state,
                                 default_recent)

KEYS = dict(qfilters_filter_source="keys")  # an online filter: caches build without a model

OLD_TO_NEW = [  # (old spelling, the same configuration spelled anew, build options, the hint)
    (dict(qfilters_mode="compress_once"), dict(mode=CompressOnce()), BuildOptions(),
     "use mode=CompressOnce()"),
    (dict(qfilters_mode="compress_once", qfilters_compression_ratio=0.25, qfilters_growth=7,
          qfilters_compress_at="manual"),
     dict(mode=CompressOnce(ratio=0.25, growth=7, at="manual")), BuildOptions(),
     "use mode=CompressOnce(ratio=0.25, growth=7, at='manual')"),
    (dict(qfilters_mode="streaming"), dict(mode=Streaming()), BuildOptions(), "use mode=Streaming()"),
    (dict(qfilters_backend="reference"), {}, BuildOptions(backend="reference"),
     "use the keywords backend='reference' where the caches are built"),
    (dict(qfilters_max_rewind=5), {}, BuildOptions(max_rewind=5), "the keywords max_rewind=5 where"),
    (dict(kv_bits=4, kv_group_size=32), {}, BuildOptions(kv_bits=4, kv_group_size=32),
     "the keywords kv_bits=4, kv_group_size=32 where"),
]


@pytest.mark.parametrize("old,new,options,hint", OLD_TO_NEW)
def test_old_spellings_warn_once_naming_the_new_one_and_map_to_it(old, new, options, hint):
    with pytest.warns(DeprecationWarning) as record:
        cfg = KVCacheConfig(**old, **KEYS)
    assert len(record) == 1
    message = str(record[0].message)
    assert all(f"{name}={value!r}" in message for name, value in old.items()) and hint in message
    assert record[0].filename == __file__  # points at the caller's line
    assert cfg.mode == KVCacheConfig(**new, **KEYS).mode
    # the old attributes read back what was given (else the defaults), without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, value in old.items():
            assert getattr(cfg, name) == value
        assert (cfg.qfilters_backend, cfg.qfilters_max_rewind, cfg.kv_bits, cfg.kv_group_size) == (
            options.backend, options.max_rewind, options.kv_bits, options.kv_group_size)
        assert KVCacheBuilder().options_for(cfg) == options
        assert dataclasses.replace(cfg, qfilters_budget=512).qfilters_backend == options.backend


def test_reading_the_defaults_by_their_old_names():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = KVCacheConfig()
        assert (c.qfilters_mode, c.qfilters_compression_ratio, c.qfilters_growth,
                c.qfilters_compress_at) == ("streaming", None, None, "prompt_end")
        assert (c.qfilters_backend, c.qfilters_max_rewind, c.kv_bits, c.kv_group_size) == (
            "auto", DEFAULT_MAX_REWIND, None, DEFAULT_KV_GROUP_SIZE)
        assert DEFAULT_MAX_REWIND == "auto" and KVCacheBuilder().options_for() == BuildOptions()
        once = KVCacheConfig(mode=CompressOnce(ratio=0.5, growth=3, at="manual"), **KEYS)
        assert (once.qfilters_mode, once.qfilters_compression_ratio, once.qfilters_growth,
                once.qfilters_compress_at, once.compress_once) == ("compress_once", 0.5, 3, "manual", True)
    # explicit defaults spelled the old way equal the default configuration
    with pytest.warns(DeprecationWarning):
        assert KVCacheConfig(qfilters_backend="auto", qfilters_max_rewind="auto") == KVCacheConfig()


def test_fields_are_the_method_only():
    names = [f.name for f in dataclasses.fields(KVCacheConfig) if not f.name.startswith("_")]
    assert names == ["method", "head_dim", "qfilters_budget", "qfilters_n_sink", "qfilters_recent",
                     "qfilters_calib_tokens", "qfilters_sign", "qfilters_filter_source",
                     "qfilters_filters", "qfilters_seed", "mode"]
    assert "backend" not in repr(KVCacheConfig()) and "mode=Streaming()" in repr(KVCacheConfig())
    assert KVCacheConfig("l2norm", 64).head_dim == 64  # positional, in field order


BAD = [  # (kwargs, exception, the name the message must give)
    (dict(method="h2o"), ValueError, "method"),
    (dict(head_dim=0), ValueError, "head_dim"),
    (dict(head_dim=8.0), TypeError, "head_dim"),
    (dict(qfilters_budget=0), ValueError, "qfilters_budget"),
    (dict(qfilters_budget="8"), TypeError, "qfilters_budget"),
    (dict(qfilters_n_sink=-1), ValueError, "qfilters_n_sink"),
    (dict(qfilters_recent=-1), ValueError, "qfilters_recent"),
    (dict(qfilters_recent="all"), ValueError, "qfilters_recent"),
    (dict(qfilters_recent=[[1, 2], [3]]), ValueError, "qfilters_recent"),
    (dict(qfilters_calib_tokens=0), ValueError, "qfilters_calib_tokens"),
    (dict(qfilters_sign=0), ValueError, "qfilters_sign"),
    (dict(qfilters_sign=-1, qfilters_filter_source="queries"), ValueError, "qfilters_sign"),
    (dict(qfilters_filter_source="values"), ValueError, "qfilters_filter_source"),
    (dict(qfilters_filters="/no/such/file.safetensors"), ValueError, "qfilters_filters"),
    (dict(qfilters_filters=np.zeros((2, 3))), ValueError, "qfilters_filters"),
    (dict(qfilters_seed=-1), ValueError, "qfilters_seed"),
    (dict(mode="compress_once"), TypeError, "mode"),
    (dict(method="full", mode=CompressOnce()), ValueError, "method='full'"),
    (dict(mode=CompressOnce(), qfilters_recent=[1, 2]), ValueError, "qfilters_recent"),
]


@pytest.mark.parametrize("kwargs,exc,name", BAD)
def test_every_bad_field_raises_naming_it(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        KVCacheConfig(**{**KEYS, **kwargs})


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(ratio=1.0), ValueError, "CompressOnce.ratio"),
    (dict(ratio="0.5"), TypeError, "CompressOnce.ratio"),
    (dict(growth=-1), ValueError, "CompressOnce.growth"),
    (dict(growth=1.5), TypeError, "CompressOnce.growth"),
    (dict(at="later"), ValueError, "CompressOnce.at"),
])
def test_compress_once_fields_are_checked(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        CompressOnce(**kwargs)


@pytest.mark.parametrize("kwargs,exc,name", [
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(max_rewind=-1), ValueError, "max_rewind"),
    (dict(max_rewind=1.0), TypeError, "max_rewind"),
    (dict(kv_bits=3), ValueError, "kv_bits"),
    (dict(kv_bits="4"), TypeError, "kv_bits"),
    (dict(kv_group_size=48), ValueError, "kv_group_size"),
    (dict(kv_bits=4, max_rewind=2), ValueError, "kv_bits=4 needs max_rewind=0"),
])
def test_build_options_are_checked_where_given(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        BuildOptions(**kwargs)
    with pytest.raises(exc, match=name):
        KVCacheBuilder(**kwargs)
    with pytest.raises(exc, match=name):  # keywords of for_model: refused before the model is read
        KVCacheBuilder.for_model(object(), KVCacheConfig(**KEYS), **kwargs)


def test_old_spelling_errors_name_the_old_field():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="qfilters_backend"):
        KVCacheConfig(qfilters_backend="cuda")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="qfilters_max_rewind=0"):
        KVCacheConfig(kv_bits=4, qfilters_max_rewind=1)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="qfilters_growth"):
        KVCacheConfig(qfilters_growth=3)  # streaming: would be ignored
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="qfilters_mode"):
        KVCacheConfig(qfilters_mode="once")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="qfilters_compression_ratio"):
        KVCacheConfig(qfilters_mode="compress_once", qfilters_compression_ratio=1.0)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="qfilters_compression_ratio"):
        KVCacheConfig(qfilters_mode="compress_once", qfilters_compression_ratio="0.5")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError,
                                                         match="qfilters_compression_ratio.*compress_once"):
        KVCacheConfig(qfilters_compression_ratio=0.5)  # streaming mode: would be ignored
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="qfilters_compress_at"):
        KVCacheConfig(qfilters_mode="compress_once", qfilters_compress_at="later")
    with pytest.warns(DeprecationWarning):  # compress-once: no recent window
        assert KVCacheConfig(qfilters_mode="compress_once").qfilters_recent == 0


def test_a_keyword_and_a_deprecated_value_that_disagree_raise_naming_both():
    with pytest.warns(DeprecationWarning):
        cfg = KVCacheConfig(qfilters_backend="reference", qfilters_max_rewind=4, **KEYS)
    b = KVCacheBuilder()
    with pytest.raises(ValueError, match=r"backend='cpp'.*qfilters_backend='reference'"):
        b.options_for(cfg, backend="cpp")
    with pytest.raises(ValueError, match=r"max_rewind=2.*qfilters_max_rewind=4"):
        KVCacheBuilder(max_rewind=2).for_model(object(), cfg)
    # agreeing values, and keywords over what the configuration left at its default
    assert b.options_for(cfg, backend="reference", kv_bits=None) == BuildOptions("reference", 4)
    assert b.options_for(cfg, kv_group_size=32) == BuildOptions("reference", 4, None, 32)
    # a call's keyword over the builder's
    assert KVCacheBuilder(backend="cpp").options_for(None, backend="reference").backend == "reference"


def test_replace_keeps_resolved_windows_and_signs_until_given_none_again():
    """``qfilters_recent=None`` and ``qfilters_sign=None`` resolve at construction; the field
    then reads the resolved value, which ``dataclasses.replace`` carries over."""
    c = KVCacheConfig()
    assert c.qfilters_recent == default_recent(256, 4) == 128
    wider = dataclasses.replace(c, qfilters_budget=512)
    assert wider.qfilters_recent == 128  # kept, not resolved for 512
    assert dataclasses.replace(c, qfilters_budget=512, qfilters_recent=None).qfilters_recent == 256
    once = dataclasses.replace(c, mode=CompressOnce(), qfilters_recent=None)
    assert once.qfilters_recent == 0  # compress-once has no window by default
    keys = dataclasses.replace(c, qfilters_filter_source="keys")
    assert keys.qfilters_sign == 1  # the query filter's resolved +1 is kept
    assert dataclasses.replace(c, qfilters_filter_source="keys", qfilters_sign=None).qfilters_sign == -1
    with warnings.catch_warnings():  # replace on the new fields warns about nothing
        warnings.simplefilter("error")
        dataclasses.replace(once, mode=Streaming(), qfilters_recent=None)
    with pytest.warns(DeprecationWarning):  # an old spelling given to replace edits the mode
        grown = dataclasses.replace(KVCacheConfig(mode=CompressOnce(ratio=0.5)), qfilters_growth=8)
    assert grown.mode == CompressOnce(ratio=0.5, growth=8)


def test_saved_form_is_the_flat_field_layout_and_reads_back():
    with pytest.warns(DeprecationWarning):
        cfg = KVCacheConfig(qfilters_backend="reference", mode=CompressOnce(ratio=0.5), **KEYS)
    state = config_to_state(cfg)
    assert sorted(state) == sorted([
        "method", "head_dim", "qfilters_budget", "qfilters_n_sink", "qfilters_recent",
        "qfilters_calib_tokens", "qfilters_sign", "qfilters_seed", "qfilters_backend",
        "qfilters_filter_source", "qfilters_max_rewind", "qfilters_filters", "qfilters_mode",
        "qfilters_compression_ratio", "qfilters_growth", "qfilters_compress_at", "kv_bits",
        "kv_group_size"])
    assert (state["qfilters_mode"], state["qfilters_compression_ratio"], state["qfilters_backend"]) == (
        "compress_once", 0.5, "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back, options = config_from_state(state)
    assert back == KVCacheConfig(mode=CompressOnce(ratio=0.5), **KEYS)
    assert options == BuildOptions(backend="reference")
    assert config_to_state(back, options) == state


def _tiny():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=97, num_key_value_heads=2, head_dim=32, rope_theta=1e4,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_build_keywords_reach_every_cache_like_the_old_spelling():
    """backend, max_rewind, kv_bits/kv_group_size given to for_model, install or the builder
    make the same caches as the deprecated configuration fields did: same backend, same rewind
    depth (a rewind within it succeeds after an eviction, one beyond raises), same storage."""
    model = _tiny()
    cfg = KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1, qfilters_recent=2, **KEYS,
                        qfilters_calib_tokens=4)
    with pytest.warns(DeprecationWarning):
        old_cfg = KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1, qfilters_recent=2, **KEYS,
                                qfilters_calib_tokens=4, qfilters_backend="reference",
                                qfilters_max_rewind=3)
    builds = {
        "keywords": KVCacheBuilder.for_model(model, cfg, backend="reference", max_rewind=3),
        "builder": KVCacheBuilder(backend="reference", max_rewind=3).for_model(model, cfg),
        "old": KVCacheBuilder.for_model(model, old_cfg),
    }
    tokens = mx.array([[5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]])
    outs = {}
    for name, caches in builds.items():
        assert {c.backend.name for c in caches} == {"reference"}
        outs[name] = np.array(model(tokens, cache=caches))
        assert all(c.size() == 8 for c in caches)  # evicted
        assert all(c.is_trimmable() for c in caches)
        with pytest.raises(ValueError):
            caches[0].trim(4)  # beyond the depth: refused
        assert caches[1].trim(3) == 3
    assert np.array_equal(outs["keywords"], outs["old"]) and np.array_equal(outs["builder"], outs["old"])
    # quantized storage: keyword and old spelling build the same class with the same bits
    q = KVCacheBuilder.for_model(model, cfg, kv_bits=4, kv_group_size=32)
    with pytest.warns(DeprecationWarning):
        old_q = dataclasses.replace(cfg, kv_bits=4, kv_group_size=32)
    q_old = KVCacheBuilder.for_model(model, old_q)
    assert [type(c) for c in q] == [type(c) for c in q_old] and type(q[0]).__name__ != "QFiltersKVCache"
    assert {(c.bits, c.group_size) for c in q} == {(c.bits, c.group_size) for c in q_old} == {(4, 32)}
    # install: fresh caches per make_cache() with the keywords
    KVCacheBuilder.install(model, cfg, backend="reference", max_rewind=3)
    fresh = model.make_cache()
    assert {c.backend.name for c in fresh} == {"reference"} and fresh[0].size() == 0


# ------------------------------------------------ the cache constructors, as the old spelling
D = 64
CHUNKS = [12, 20, 1, 1, 1, 5, 1, 1, 1]


def config(**kw):
    """A key-SVD configuration (``kw``: more fields, or the deprecated spellings)."""
    return KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4, **KEYS,
                         qfilters_calib_tokens=8, qfilters_sign=-1, **kw)


def kv(seed, T=sum(CHUNKS)):
    mx.random.seed(seed)
    return mx.random.normal((1, 2, T, D)).astype(mx.float16), mx.random.normal((1, 2, T, D)).astype(mx.float16)


def feed(caches, k, v, chunks=CHUNKS):
    """Feed the same calls to every cache; yield each call's outputs (one per cache)."""
    t = 0
    for n in chunks:
        yield [c.update_and_fetch(k[:, :, t : t + n], v[:, :, t : t + n]) for c in caches]
        t += n


def same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b))


def test_kv_bits_config_is_refused_by_the_dense_class_and_picked_by_build_cache():
    with pytest.deprecated_call():
        cfg = config(kv_bits=8)
    with pytest.raises(ValueError, match="QuantizedQFiltersKVCache.*build_cache"):
        QFiltersKVCache(cfg)
    q = build_cache(cfg, layer_idx=3)
    assert type(q) is QuantizedQFiltersKVCache and (q.bits, q.group_size, q.layer_idx) == (8, 64, 3)
    plain = build_cache(config())
    assert type(plain) is QFiltersKVCache and not hasattr(plain, "bits")
    with pytest.raises(TypeError, match="KVCacheConfig, got dict"):
        build_cache({"kv_bits": 8})




@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_bits_given_to_the_constructor_equal_bits_from_the_config(bits, group_size):
    k, v = kv(1)
    given = QuantizedQFiltersKVCache(config(), bits=bits, group_size=group_size)
    with pytest.deprecated_call():
        from_config = QuantizedQFiltersKVCache(config(kv_bits=bits, kv_group_size=group_size))
    for a, b in feed([given, from_config], k, v):
        assert same(a, b)
    assert (given.bits, given.group_size) == (bits, group_size) and given.evicted
    sa, sb = given.state, from_config.state
    assert all(same(x, y) for x, y in zip(sa[:6], sb[:6]) if x is not None)
    saved = config_from_state(json.loads(sa[6])["config"])[1]  # saved: what the cache uses
    assert (saved.kv_bits, saved.kv_group_size) == (bits, group_size)
    loaded = QuantizedQFiltersKVCache.from_state(sa)
    assert (loaded.bits, loaded.group_size) == (bits, group_size)


def test_max_rewind_and_backend_given_to_the_constructor_equal_the_config_fields():
    k, v = kv(2)
    given = QFiltersKVCache(config(), backend="reference", max_rewind=4)
    with pytest.deprecated_call():
        from_config = QFiltersKVCache(config(qfilters_backend="reference", qfilters_max_rewind=4))
    assert given.backend.name == "reference" and given.max_rewind == 4 and given.is_trimmable()
    assert not QFiltersKVCache(config(), max_rewind=0).is_trimmable()
    for a, b in feed([given, from_config], k, v):
        assert same(a, b)
    assert given.trim(3) == from_config.trim(3) == 3
    np.testing.assert_array_equal(np.array(given.kept_positions()), np.array(from_config.kept_positions()))
    with pytest.raises(ValueError, match="max_rewind=4"):  # the rewind depth in use
        given.trim(10)
    saved = config_from_state(json.loads(given.state[6])["config"])[1]
    assert saved == BuildOptions(backend="reference", max_rewind=4)
    loaded = QFiltersKVCache.from_state(given.state)
    assert loaded.max_rewind == 4 and loaded.backend.name == "reference"
