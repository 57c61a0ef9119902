"""How a cache is built: ``QFiltersKVCache`` and its sibling ``QuantizedQFiltersKVCache``
(picked by the caller, ``build_cache`` or ``KVCacheBuilder``; never switched silently), and
the build options given to the constructor (``backend``, ``max_rewind``, ``bits``,
``group_size``). References: mlx-lm's class layout (one base, ``_BaseCache``)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import _BaseCache

from qfilters_mlx import KVCacheConfig, QFiltersKVCache
from qfilters_mlx.cache.kv_cache import QuantizedQFiltersKVCache, build_cache

D = 64


def config(**kw):
    base = dict(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4, qfilters_calib_tokens=8,
                qfilters_filter_source="keys", qfilters_sign=-1)
    return KVCacheConfig(**{**base, **kw})


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
    # the defaults: layer 0, no filter, backend "auto", rewind depth "auto"
    d = build_cache(config(), bits=bits)
    assert (d.layer_idx, d.filter, d._backend_name, d.max_rewind) == (0, None, "auto", "auto")


def test_one_base_class_and_the_quantized_sibling_overrides_no_step_of_the_hot_path():
    assert QFiltersKVCache.__bases__ == (_BaseCache,)
    assert QuantizedQFiltersKVCache.__bases__ == (QFiltersKVCache,)
    own = set(vars(QuantizedQFiltersKVCache))
    hot = {"update_and_fetch", "_update", "_append", "_score", "_evict", "_decode_step", "_calibrate",
           "_validate", "observe_queries", "compress", "trim", "state", "nbytes", "to_quantized"}
    assert not own & hot, own & hot


def test_bad_build_options_raise_naming_the_value():
    with pytest.raises(ValueError, match="max_rewind must be >= 0"):
        QFiltersKVCache(config(), max_rewind=-1)
    with pytest.raises(ValueError, match="kv_bits must be None or one of"):
        QuantizedQFiltersKVCache(config(), bits=3)
    with pytest.raises(ValueError, match="kv_group_size must be one of"):
        QuantizedQFiltersKVCache(config(), bits=4, group_size=48)
    with pytest.raises(ValueError, match="kv_bits=4 needs .*max_rewind=0"):
        QuantizedQFiltersKVCache(config(), bits=4, max_rewind=2)
    with pytest.raises(ValueError, match="backend must be one of"):
        QFiltersKVCache(config(), backend="cuda")


def test_rows_built_with_different_options_do_not_share_a_batch():
    with pytest.raises(ValueError, match="build options.*max_rewind: 4 vs 'auto'"):
        QFiltersKVCache.merge([QFiltersKVCache(config(), max_rewind=4), QFiltersKVCache(config())])
    with pytest.raises(ValueError, match="build options.*bits: 4 vs 8"):
        QFiltersKVCache.merge([QuantizedQFiltersKVCache(config(), bits=4),
                               QuantizedQFiltersKVCache(config(), bits=8)])


def test_refusals_at_construction_name_the_fix():
    """Without calibrated filters the default filter source says where they come from; the
    plain class takes no bits (the quantized sibling does)."""
    with pytest.raises(ValueError) as err:
        QFiltersKVCache(KVCacheConfig(method="qfilters"))
    assert str(err.value) == (
        "qfilters_filter_source='calibrated' (the default) scores with the model's calibrated query filter, "
        "which KVCacheBuilder.for_model / install find or make: build the caches with them, pass filters= "
        "([H_kv, D]), or choose an online filter (qfilters_filter_source='queries' inside observe_queries, "
        "or 'keys')")
    with pytest.raises(TypeError, match="bits"):
        QFiltersKVCache(config(), bits=4)
    with pytest.raises(ValueError, match="QuantizedQFiltersKVCache needs bits="):
        QuantizedQFiltersKVCache(config())
