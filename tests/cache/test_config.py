"""KVCacheConfig's fields, its mode objects, the build options apart from it, and the 0.1
spellings removed in 0.3.0 (TypeError naming the new spelling)."""

import dataclasses
import json
import re

import mlx.core as mx
import numpy as np
import pytest

from qfilters_mlx import KVCacheBuilder, KVCacheConfig, QFiltersKVCache
from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache, build_cache
from qfilters_mlx.config import (DEFAULT_MAX_REWIND, BuildOptions, CompressOnce, Streaming,
                                 build_from_state, config_from_state, config_to_state,
                                 default_recent, from_format1)

KEYS = dict(qfilters_filter_source="keys")  # an online filter: caches build without a model

REMOVED = [  # (0.1 spelling, what the TypeError must say to write instead)
    (dict(qfilters_mode="compress_once"), "mode=CompressOnce("),
    (dict(qfilters_compression_ratio=0.25), "mode=CompressOnce(ratio=...)"),
    (dict(qfilters_growth=7), "mode=CompressOnce(growth=...)"),
    (dict(qfilters_compress_at="manual"), "mode=CompressOnce(at=...)"),
    (dict(qfilters_backend="reference"), "the keyword backend= where the caches are built"),
    (dict(qfilters_max_rewind=5), "the keyword max_rewind= where the caches are built"),
    (dict(kv_bits=4), "the keyword kv_bits= where the caches are built"),
    (dict(kv_group_size=32), "the keyword kv_group_size= where the caches are built"),
]


@pytest.mark.parametrize("old,hint", REMOVED, ids=lambda x: next(iter(x)) if isinstance(x, dict) else "")
def test_a_removed_spelling_raises_type_error_naming_the_new_one(old, hint):
    (name,) = old
    with pytest.raises(TypeError) as err:
        KVCacheConfig(**old, **KEYS)
    message = str(err.value)
    assert f"'{name}'" in message and "removed in 0.3.0" in message and hint in message
    with pytest.raises(TypeError, match=name):  # dataclasses.replace constructs anew
        dataclasses.replace(KVCacheConfig(**KEYS), **old)
    with pytest.raises(AttributeError):  # no legacy property reads it back
        getattr(KVCacheConfig(**KEYS), name)


def test_reading_a_removed_spelling_names_where_the_value_is_read_now():
    """``config.<0.1 name>`` raises ``AttributeError`` naming an expression; that expression,
    evaluated on the configuration and a cache built with the value, gives the value back."""
    given = {"qfilters_mode": "compress_once", "qfilters_compression_ratio": 0.25,
             "qfilters_growth": 7, "qfilters_compress_at": "manual", "qfilters_backend": "reference",
             "qfilters_max_rewind": 0, "kv_bits": 4, "kv_group_size": 32}
    config = KVCacheConfig(head_dim=64, **KEYS, mode=CompressOnce(ratio=0.25, growth=7, at="manual"))
    cache = build_cache(config, 0, bits=4, group_size=32, backend="reference", max_rewind=0)
    for name, value in given.items():
        with pytest.raises(AttributeError, match=rf"^KVCacheConfig\.{name} was removed in 0\.3\.0 "
                                                 r"\(a 0\.1/0\.2 spelling\): read ") as err:
            getattr(config, name)
        where = re.search(r"read (\S+)", str(err.value)).group(1)
        assert eval(where, {"config": config, "cache": cache}) == value, (name, where)
    with pytest.raises(AttributeError, match=r"^'KVCacheConfig' object has no attribute 'zzz'$"):
        config.zzz
    assert getattr(config, "kv_bits", None) is None  # (getattr with a default still answers)


def test_several_removed_spellings_are_named_together_and_nothing_else_is_accepted():
    with pytest.raises(TypeError, match=r"\['qfilters_mode', 'qfilters_growth', 'kv_bits'\]"):
        KVCacheConfig(qfilters_mode="compress_once", qfilters_growth=3, kv_bits=4)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['budget'\\]"):
        KVCacheConfig(budget=8)


def test_the_seed_spelling_builds_with_for_model():
    """The method page's spelling: ``KVCacheConfig(method="qfilters", head_dim=..., qfilters_budget=...,
    qfilters_n_sink=..., qfilters_recent=..., qfilters_calib_tokens=..., qfilters_sign=...)`` with
    ``KVCacheBuilder.for_model`` (key-SVD filter here: no calibration run)."""
    config = KVCacheConfig(method="qfilters", head_dim=32, qfilters_budget=8, qfilters_n_sink=2,
                           qfilters_recent=0, qfilters_calib_tokens=4, qfilters_sign=1, **KEYS)
    caches = KVCacheBuilder.for_model(_tiny(), config)
    assert [c.config for c in caches] == [config, config]
    assert all((c.scorer.sign, c.recent_window, c.max_rewind) == (1, 0, DEFAULT_MAX_REWIND)
               for c in caches)


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
    assert dataclasses.replace(once, mode=Streaming(), qfilters_recent=None).qfilters_recent == 128


def test_saved_form_uses_the_current_names_and_reads_back():
    cfg = KVCacheConfig(mode=CompressOnce(ratio=0.5), **KEYS)
    state = config_to_state(cfg)
    assert sorted(state) == sorted([
        "method", "head_dim", "qfilters_budget", "qfilters_n_sink", "qfilters_recent",
        "qfilters_calib_tokens", "qfilters_sign", "qfilters_seed", "qfilters_filter_source",
        "qfilters_filters", "mode"])
    assert state["mode"] == {"name": "compress_once", "ratio": 0.5, "growth": None, "at": "prompt_end"}
    assert json.loads(json.dumps(state)) == state
    assert config_from_state(state) == cfg
    assert config_to_state(KVCacheConfig())["mode"] == {"name": "streaming"}
    with pytest.raises(ValueError, match="saved mode"):
        config_from_state({**state, "mode": {"name": "later"}})


FORMAT1_CONFIG = {  # a flat format-1 "config" as 0.2.0 wrote it (field by field)
    "method": "qfilters", "head_dim": 64, "qfilters_budget": 16, "qfilters_n_sink": 2,
    "qfilters_recent": 0, "qfilters_calib_tokens": 8, "qfilters_sign": -1, "qfilters_seed": 0,
    "qfilters_filter_source": "keys", "qfilters_filters": None, "qfilters_mode": "compress_once",
    "qfilters_compression_ratio": 0.25, "qfilters_growth": 3, "qfilters_compress_at": "manual",
    "qfilters_backend": "reference", "qfilters_max_rewind": 0, "kv_bits": 4, "kv_group_size": 32}


def test_the_format1_translator_moves_each_old_field_where_the_table_says():
    meta = {"config": dict(FORMAT1_CONFIG), "offset": "7", "kv_format": [64, 64, "float16"]}
    out = from_format1(meta)
    assert meta["config"] == FORMAT1_CONFIG and "format" not in meta  # (the input is not changed)
    assert out["format"] == 2 and (out["offset"], out["kv_format"]) == ("7", [64, 64, "float16"])
    assert out["build"] == {"backend": "reference", "max_rewind": 0, "kv_bits": 4, "kv_group_size": 32}
    assert out["config"]["mode"] == {"name": "compress_once", "ratio": 0.25, "growth": 3, "at": "manual"}
    assert config_from_state(out["config"]) == KVCacheConfig(
        head_dim=64, qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=0, qfilters_calib_tokens=8,
        qfilters_sign=-1, **KEYS, mode=CompressOnce(ratio=0.25, growth=3, at="manual"))
    assert build_from_state(out["build"]) == BuildOptions("reference", 0, 4, 32)
    # streaming: the unused compress-once fields are dropped; None build options take the defaults
    flat = {**FORMAT1_CONFIG, "qfilters_mode": "streaming", "qfilters_compression_ratio": None,
            "qfilters_growth": None, "qfilters_compress_at": "prompt_end", "kv_bits": None,
            "qfilters_max_rewind": "auto"}
    out = from_format1({"config": flat})
    assert out["config"]["mode"] == {"name": "streaming"}
    assert build_from_state(out["build"]) == BuildOptions(backend="reference", kv_group_size=32)
    with pytest.raises(ValueError, match="format-1 meta without a 'config'"):
        from_format1({"offset": "3"})


@pytest.mark.parametrize("meta, got", [
    ({"config": FORMAT1_CONFIG, "format": 1}, "['format']"),
    ({"config": FORMAT1_CONFIG, "build": {}}, "['build']"),
    ({"config": {**FORMAT1_CONFIG, "mode": {"name": "streaming"}}}, "['config.mode']"),
    ({"config": {k: v for k, v in FORMAT1_CONFIG.items() if k != "qfilters_mode"}}, "no qfilters_mode"),
])
def test_the_format1_translator_refuses_a_meta_that_is_not_format1(meta, got):
    """Format 1 had no marker, no ``"build"`` and no ``"mode"``, and always a ``qfilters_mode``:
    anything else is refused, not translated into a default mode and backend."""
    with pytest.raises(ValueError, match=rf"^state: not a format-1 meta \(.*; got {re.escape(got)}\)$"):
        from_format1(meta)


@pytest.mark.parametrize("field", ["qfilters_compression_ratio", "qfilters_growth"])
def test_the_format1_translator_refuses_compress_once_fields_with_streaming(field):
    """As 0.2 refused ``KVCacheConfig(qfilters_mode="streaming", qfilters_growth=3)``;
    ``qfilters_compress_at``, which 0.2 ignored with streaming, is dropped."""
    flat = {**FORMAT1_CONFIG, "qfilters_mode": "streaming", "qfilters_compression_ratio": None,
            "qfilters_growth": None, field: FORMAT1_CONFIG[field]}
    with pytest.raises(ValueError, match=rf"^state: format-1 config sets \['{field}'\] with "
                                         r"qfilters_mode='streaming'"):
        from_format1({"config": flat})


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


def test_build_keywords_reach_every_cache():
    """backend, max_rewind, kv_bits/kv_group_size given to for_model, install or the builder
    reach every cache: same backend, same rewind depth (a rewind within it succeeds after an
    eviction, one beyond raises), same storage; the configuration carries none of them."""
    model = _tiny()
    cfg = KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1, qfilters_recent=2, **KEYS,
                        qfilters_calib_tokens=4)
    builds = {
        "keywords": KVCacheBuilder.for_model(model, cfg, backend="reference", max_rewind=3),
        "builder": KVCacheBuilder(backend="reference", max_rewind=3).for_model(model, cfg),
    }
    tokens = mx.array([[5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43]])
    outs = {}
    for name, caches in builds.items():
        assert {c.backend.name for c in caches} == {"reference"}
        outs[name] = np.array(model(tokens, cache=caches))
        assert all(c.size() == 8 for c in caches)  # evicted
        assert all(c.is_trimmable() for c in caches)
        with pytest.raises(ValueError, match="max_rewind=3"):
            caches[0].trim(4)  # beyond the depth: refused
        assert caches[1].trim(3) == 3
    assert np.array_equal(outs["keywords"], outs["builder"])
    q = KVCacheBuilder.for_model(model, cfg, kv_bits=4, kv_group_size=32)
    assert {type(c) for c in q} == {QuantizedQFiltersKVCache}
    assert {(c.bits, c.group_size) for c in q} == {(4, 32)}
    assert KVCacheBuilder(kv_bits=8).options_for(cfg, kv_bits=4) == BuildOptions(kv_bits=4)
    # install: fresh caches per make_cache() with the keywords
    KVCacheBuilder.install(model, cfg, backend="reference", max_rewind=3)
    fresh = model.make_cache()
    assert {c.backend.name for c in fresh} == {"reference"} and fresh[0].size() == 0




@pytest.mark.parametrize("cls,kw,saved", [
    (QFiltersKVCache, dict(backend="reference", max_rewind=4), BuildOptions("reference", 4)),
    (QuantizedQFiltersKVCache, dict(bits=8, group_size=32), BuildOptions(kv_bits=8, kv_group_size=32)),
])
def test_constructor_options_are_saved_as_build_options_and_loaded_back(cls, kw, saved):
    cfg = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4, **KEYS,
                        qfilters_calib_tokens=8)
    mx.random.seed(2)
    k = mx.random.normal((1, 2, 30, 64)).astype(mx.float16)
    cache = cls(cfg, **kw)
    cache.update_and_fetch(k, k)
    meta = json.loads(cache.state[6])
    assert meta["format"] == 2 and build_from_state(meta["build"]) == saved
    loaded = cls.from_state(cache.state)
    assert (loaded.backend.name, loaded.max_rewind) == (saved.backend if saved.backend != "auto"
                                                         else cache.backend.name, saved.max_rewind)
    assert getattr(loaded, "bits", None) == saved.kv_bits and loaded.config == cfg
    assert type(build_cache(cfg, bits=saved.kv_bits)) is cls
