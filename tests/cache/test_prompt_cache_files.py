"""mlx-lm prompt-cache files round-trip QFiltersKVCache exactly."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from qfilters_mlx import KVCacheConfig, QFiltersKVCache


def bits(a):
    if a is None:
        return None
    a = a.astype(mx.float32) if a.dtype == mx.bfloat16 else a
    return np.array(a)


def attrs(c):
    return {
        "cls": type(c), "config": c.config, "offset": c.offset, "layer_idx": c.layer_idx,
        "evicted": c.evicted, "size": c.size(), "backend": c.backend.name,
        "filter_is_none": c.filter is None,
    }


@pytest.mark.parametrize("method,dtype", [("qfilters", mx.float16), ("l2norm", mx.bfloat16),
                                          ("random", mx.float32), ("full", mx.float32)])
def test_round_trip_after_eviction(tmp_path, method, dtype):
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((1, 2, 110, 16)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, 2, 110, 16)).astype(np.float32)).astype(dtype)
    caches = [QFiltersKVCache(KVCacheConfig(method=method, qfilters_budget=32, qfilters_n_sink=2,
                                            qfilters_recent=4, qfilters_calib_tokens=20,
                                            qfilters_filter_source="keys"), layer_idx=i, backend="reference")
              for i in range(2)]
    for c in caches:
        c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches, metadata={"note": "x"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "x"}
    for a, b in zip(caches, loaded):
        assert attrs(a) == attrs(b)
        assert type(b.evicted) is bool and type(b.offset) is int
        for x, y in zip(a.state[:5], b.state[:5]):
            if x is None:
                assert y is None
            else:
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(bits(x), bits(y))
    # the next 10 decode steps give identical outputs
    for t in range(100, 110):
        for a, b in zip(caches, loaded):
            ka, va = a.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
            kb, vb = b.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
            np.testing.assert_array_equal(bits(ka), bits(kb))
            np.testing.assert_array_equal(bits(va), bits(vb))
            np.testing.assert_array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))


def test_round_trip_offset_beyond_int32_and_empty_cache(tmp_path):
    cfg = KVCacheConfig(qfilters_budget=8, qfilters_n_sink=1, qfilters_calib_tokens=4, qfilters_recent=0,
                        qfilters_filter_source="keys")
    big = QFiltersKVCache(cfg, backend="reference")
    big.offset = 2**31 + 7  # as if that many tokens had been fed
    k = mx.ones((1, 1, 12, 8))
    big.update_and_fetch(k, k)
    empty = QFiltersKVCache(cfg, layer_idx=1, backend="reference")
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [big, empty])
    a, b = load_prompt_cache(path)
    assert a.offset == 2**31 + 19 and a.evicted is True
    np.testing.assert_array_equal(np.array(a.kept_positions()), np.array(big.kept_positions()))
    # equal scores: the earliest positions win; all exact beyond 2**31
    np.testing.assert_array_equal(np.array(a.kept_positions())[0, 0], 2**31 + 7 + np.arange(8))
    assert b.empty() and b.offset == 0 and b.evicted is False and b.layer_idx == 1
    b.update_and_fetch(k, k)
    assert b.size() == 8


def test_reload_after_the_filters_file_moved(tmp_path):
    """A cache built from a filters file saves the layer's filter itself: the file may be gone
    when the prompt cache is loaded, and the reloaded cache continues bit for bit."""
    rng = np.random.default_rng(3)
    filters_path = tmp_path / "filters.safetensors"
    filt = rng.standard_normal((2, 16)).astype(np.float32)
    mx.save_safetensors(str(filters_path), {"x": mx.array(filt)})  # only has to exist
    config = KVCacheConfig(qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4,
                           qfilters_filters=str(filters_path))
    cache = QFiltersKVCache(config, filters=mx.array(filt), backend="reference")
    k = mx.array(rng.standard_normal((1, 2, 41, 16)).astype(np.float32))
    cache.update_and_fetch(k[:, :, :40], k[:, :, :40])
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [cache])
    filters_path.unlink()
    (loaded,) = load_prompt_cache(path)
    assert loaded.config.qfilters_filters is None and loaded.filter_fixed
    np.testing.assert_array_equal(bits(loaded.filter), filt)
    want = cache.update_and_fetch(k[:, :, 40:], k[:, :, 40:])
    got = loaded.update_and_fetch(k[:, :, 40:], k[:, :, 40:])
    np.testing.assert_array_equal(bits(got[0]), bits(want[0]))
    np.testing.assert_array_equal(bits(loaded.kept_positions()), bits(cache.kept_positions()))
