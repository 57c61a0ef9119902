"""The cache's state has a shape: the live rows are one value (``cache.rows``), the limits of
an eviction are resolved once (``cache.limits``: at setup, load and compression, never asked of
the configuration per call), and the streaming eviction and the compression run one routine.
References: a twin cache fed the same calls (outputs equal), the compress-once rule written out
(``K = int(T * (1 - ratio))``, budget ``K + growth``, window cut to it)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import qfilters_mlx.cache.kv_cache as kv_cache
from qfilters_mlx import CompressOnce, KVCacheConfig, QFiltersKVCache
from qfilters_mlx.cache.rows import Limits, Rows

H, D = 2, 16
BASE = dict(qfilters_budget=12, qfilters_n_sink=2, qfilters_recent=3, qfilters_calib_tokens=8,
            qfilters_filter_source="keys")


def kv(T, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((1, H, T, D)).astype(np.float32)) for _ in range(2))


def feed(cache, k, v, chunks, start=0):
    out, t = [], start
    for n in chunks:
        out.append(tuple(np.array(a) for a in cache.update_and_fetch(k[:, :, t:t + n], v[:, :, t:t + n])))
        t += n
    return out


class Forbidden:
    """A configuration that may not be asked anything."""

    def __getattr__(self, name):
        raise AssertionError(f"the configuration was asked {name!r}")


@pytest.mark.parametrize("mode", [None, CompressOnce(ratio=0.5, growth=3)],
                         ids=["streaming", "compress_once"])
def test_after_setup_the_hot_path_asks_the_configuration_nothing(mode):
    """Once calibrated (and compressed), decode steps and chunks run with a configuration that
    raises on any read, and give what a twin with its configuration gives."""
    cfg = KVCacheConfig(**(BASE if mode is None else BASE | {"mode": mode, "qfilters_recent": 0}))
    k, v = kv(60)
    cache, twin = QFiltersKVCache(cfg, backend="reference"), QFiltersKVCache(cfg, backend="reference")
    for c in (cache, twin):
        feed(c, k, v, [20, 1])  # calibrated, evicted (streaming) or compressed (prompt_end)
    assert cache.evicted and (mode is None or cache.compressed)
    cache.config = Forbidden()
    chunks = [1, 1, 1, 5, 1, 1, 3, 1]
    for a, b in zip(feed(cache, k, v, chunks, start=21), feed(twin, k, v, chunks, start=21)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(np.array(cache.kept_positions()), np.array(twin.kept_positions()))


def test_the_live_rows_are_one_value_that_the_components_take_and_return(tmp_path):
    cfg = KVCacheConfig(**BASE)
    k, v = kv(60, seed=1)
    cache = QFiltersKVCache(cfg, backend="reference", max_rewind=4)
    assert cache.rows == Rows(None, None, None, None) and cache.keys is None
    steps = [lambda: feed(cache, k, v, [20, 1, 1]), lambda: cache.trim(2),  # slot mode, rewind
             lambda: feed(cache, k, v, [4], start=20), cache.kept_positions,  # back to temporal
             cache.shrink_to_fit, lambda: feed(cache, k, v, [1, 1], start=24),  # journaled steps
             cache.shrink_to_fit, lambda: cache.trim(2)]  # (the journal's arrays mapped, then undone)
    for step in steps:
        step()
        assert type(cache.rows) is Rows
        assert (cache.keys, cache.values, cache.scores, cache.positions) == tuple(cache.rows)
        assert not {"keys", "values", "scores", "positions"} & set(vars(cache))
    loaded = QFiltersKVCache.from_state(cache.state)
    assert type(loaded.rows) is Rows and loaded.limits == cache.limits


def test_limits_are_resolved_at_setup_and_at_the_compression():
    streaming = QFiltersKVCache(KVCacheConfig(**BASE), backend="reference")
    assert streaming.limits == Limits(12, 2, 3, False)
    per_head = QFiltersKVCache(KVCacheConfig(**{**BASE, "qfilters_recent": [1, 4]}), backend="reference")
    assert per_head.limits == Limits(12, 2, (1, 4), False) and per_head.recent_window == (1, 4)
    once = QFiltersKVCache(KVCacheConfig(**BASE | {"qfilters_recent": 5},
                                         mode=CompressOnce(ratio=0.75, growth=3, at="manual")),
                           backend="reference")
    assert once.limits.budget == math.inf and once.limits.once
    k, v = kv(40, seed=2)
    feed(once, k, v, [30])
    assert once.compress() == int(30 * (1 - 0.75)) == 7
    assert once.limits == Limits(7 + 3, 2, 5, True)  # window cut to the budget: min(5, 10 - 2)
    no_growth = QFiltersKVCache(KVCacheConfig(**BASE, mode=CompressOnce(ratio=0.5, at="manual")),
                                backend="reference")
    feed(no_growth, k, v, [30])
    no_growth.compress()
    assert no_growth.limits.budget == math.inf  # grows without limit


def test_streaming_eviction_and_compression_run_one_routine(monkeypatch):
    calls = []
    real = kv_cache.evict
    monkeypatch.setattr(kv_cache, "evict", lambda *a: calls.append(a[3:]) or real(*a))
    k, v = kv(40, seed=3)
    streaming = QFiltersKVCache(KVCacheConfig(**BASE), backend="reference")
    feed(streaming, k, v, [20])
    assert calls == [(12, 2, 3)]
    once = QFiltersKVCache(KVCacheConfig(**BASE, mode=CompressOnce(ratio=0.5, at="manual")),
                           backend="reference")
    feed(once, k, v, [20])
    once.compress()
    assert calls[1:] == [(10, 2, 3)]  # K = 10 kept of 20, 2 sinks, recent min(3, 10 - 2)
