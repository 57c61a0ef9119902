"""How a cache is built: ``QFiltersKVCache`` and its sibling ``QuantizedQFiltersKVCache``
(picked by the caller, ``build_cache`` or ``KVCacheBuilder``; never switched silently), and
the build options given to the constructor instead of the config (``backend``,
``max_rewind``, ``bits``, ``group_size``). References: the same cache built from a config
that carries the option (outputs and saved state equal), mlx-lm's class layout (one base,
``_BaseCache``)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import _BaseCache

from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache, build_cache

D = 64
CHUNKS = [12, 20, 1, 1, 1, 5, 1, 1, 1]


def config(**kw):
    base = dict(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4, qfilters_calib_tokens=8,
                qfilters_filter_source="keys", qfilters_sign=-1)
    return KVCacheConfig(**{**base, **kw})


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
    cfg = config(kv_bits=8)
    with pytest.raises(ValueError, match="QuantizedQFiltersKVCache.*build_cache"):
        QFiltersKVCache(cfg)
    q = build_cache(cfg, layer_idx=3)
    assert type(q) is QuantizedQFiltersKVCache and (q.bits, q.group_size, q.layer_idx) == (8, 64, 3)
    plain = build_cache(config())
    assert type(plain) is QFiltersKVCache and not hasattr(plain, "bits")
    with pytest.raises(TypeError, match="KVCacheConfig, got dict"):
        build_cache({"kv_bits": 8})


@pytest.mark.parametrize("bits", [None, 8])
def test_build_cache_hands_every_argument_to_the_class_it_picks(bits):
    f = mx.array(np.random.default_rng(0).standard_normal((2, D)).astype(np.float32))
    cfg = config(qfilters_filter_source="calibrated", qfilters_sign=None)
    depth = 0 if bits else 3  # (a quantized cache cannot rewind)
    c = build_cache(cfg, 2, f, bits=bits, group_size=32 if bits else None, backend="reference",
                    max_rewind=depth)
    assert type(c) is (QuantizedQFiltersKVCache if bits else QFiltersKVCache)
    assert (c.layer_idx, c._backend_name, c.max_rewind, c.filter_fixed) == (2, "reference", depth, True)
    assert bool(mx.array_equal(c.filter, f))
    if bits:
        assert (c.bits, c.group_size) == (8, 32)
    # the defaults: layer 0, no filter, the config's backend and rewind depth
    d = build_cache(config(), bits=bits)
    assert (d.layer_idx, d.filter, d._backend_name, d.max_rewind) == (0, None, "auto", "auto")


def test_one_base_class_and_the_quantized_sibling_overrides_no_step_of_the_hot_path():
    assert QFiltersKVCache.__bases__ == (_BaseCache,)
    assert QuantizedQFiltersKVCache.__bases__ == (QFiltersKVCache,)
    own = set(vars(QuantizedQFiltersKVCache))
    hot = {"update_and_fetch", "_update", "_append", "_score", "_evict", "_decode_step", "_calibrate",
           "_validate", "observe_queries", "compress", "trim", "state", "nbytes", "to_quantized"}
    assert not own & hot, own & hot


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32)])
def test_bits_given_to_the_constructor_equal_bits_from_the_config(bits, group_size):
    k, v = kv(1)
    given = QuantizedQFiltersKVCache(config(), bits=bits, group_size=group_size)
    from_config = QuantizedQFiltersKVCache(config(kv_bits=bits, kv_group_size=group_size))
    for a, b in feed([given, from_config], k, v):
        assert same(a, b)
    assert (given.bits, given.group_size) == (bits, group_size) and given.evicted
    sa, sb = given.state, from_config.state
    assert all(same(x, y) for x, y in zip(sa[:6], sb[:6]) if x is not None)
    assert json.loads(sa[6])["config"]["kv_bits"] == bits  # saved: what the cache uses
    assert json.loads(sa[6])["config"]["kv_group_size"] == group_size
    loaded = QuantizedQFiltersKVCache.from_state(sa)
    assert (loaded.bits, loaded.group_size) == (bits, group_size)


def test_max_rewind_and_backend_given_to_the_constructor_equal_the_config_fields():
    k, v = kv(2)
    given = QFiltersKVCache(config(), backend="reference", max_rewind=4)
    from_config = QFiltersKVCache(config(qfilters_backend="reference", qfilters_max_rewind=4))
    assert given.backend.name == "reference" and given.max_rewind == 4 and given.is_trimmable()
    assert not QFiltersKVCache(config(), max_rewind=0).is_trimmable()
    for a, b in feed([given, from_config], k, v):
        assert same(a, b)
    assert given.trim(3) == from_config.trim(3) == 3
    np.testing.assert_array_equal(np.array(given.kept_positions()), np.array(from_config.kept_positions()))
    with pytest.raises(ValueError, match="qfilters_max_rewind=4"):  # the rewind depth in use
        given.trim(10)
    meta = json.loads(given.state[6])["config"]
    assert (meta["qfilters_backend"], meta["qfilters_max_rewind"]) == ("reference", 4)
    loaded = QFiltersKVCache.from_state(given.state)
    assert loaded.max_rewind == 4 and loaded.backend.name == "reference"


def test_bad_build_options_raise_naming_the_value():
    with pytest.raises(ValueError, match="max_rewind must be >= 0"):
        QFiltersKVCache(config(), max_rewind=-1)
    with pytest.raises(ValueError, match="kv_bits must be None or one of"):
        QuantizedQFiltersKVCache(config(), bits=3)
    with pytest.raises(ValueError, match="kv_group_size must be one of"):
        QuantizedQFiltersKVCache(config(), bits=4, group_size=48)
    with pytest.raises(ValueError, match="kv_bits=4 needs qfilters_max_rewind=0"):
        QuantizedQFiltersKVCache(config(), bits=4, max_rewind=2)
    with pytest.raises(ValueError, match="backend must be one of"):
        QFiltersKVCache(config(), backend="cuda")


def test_rows_built_with_different_options_do_not_share_a_batch():
    with pytest.raises(ValueError, match="build options.*max_rewind: 4 vs 'auto'"):
        QFiltersKVCache.merge([QFiltersKVCache(config(), max_rewind=4), QFiltersKVCache(config())])
    with pytest.raises(ValueError, match="build options.*bits: 4 vs 8"):
        QFiltersKVCache.merge([QuantizedQFiltersKVCache(config(), bits=4),
                               QuantizedQFiltersKVCache(config(), bits=8)])
